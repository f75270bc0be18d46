"""After training: export the f-gram table and decoder, load them, evaluate perplexity, generate text."""
