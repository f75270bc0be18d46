"""Every config key, declared once: its default, meaning, range, and what a change of it does.

The lists the rest of the package needs are derived from KEYS, so a key added here is in each of them
or deliberately out of it: config.base_config (defaults), NUMERIC_RULES (ranges validate checks),
RESUME_KEYS (what a resume may not change) and LOOP_ONLY_KEYS (what the exported train step's key
leaves out, training/exported_step.py). A key's role says the last two: STATE keys define the saved
state or the data stream, SETTING keys may change between runs but shape the compiled train step,
LOOP keys are the loop's cadence, paths and switches, which the train step never reads. A new key
defaults to nothing: its declaration names its role, so it cannot fall out of the exported step's key
(a stale traced program would then be loaded silently) without saying so. A key whose default is a
Group (data.mixture, data.eval_sets) holds named entries, set whole; config.resolve parses the
command-line shorthand of each (in data.train_files, data.eval_files) into it.

Kept free of imports from the package, so every layer can read it (the checkpointer included).
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Role:
    resume: bool  # a resume may change the key's value (else refused naming it, unless --allow_config_change)
    program: bool  # the key is part of the exported train step's key (else a change loads the traced program)


STATE = Role(resume=False, program=True)  # defines the saved state or the data stream
SETTING = Role(resume=True, program=True)  # may change between runs; the compiled train step depends on it
LOOP = Role(resume=True, program=False)  # the loop's own: the train step never reads it


@dataclasses.dataclass(frozen=True)
class Key:
    name: str  # 'section.key'
    default: object  # its type is the key's type (a --config override is read as it)
    role: Role
    doc: str
    rule: str = ""  # numbers: the range validate() checks (config.RULE_TESTS), e.g. '>= 1'
    hint: str = ""  # said after a broken rule, e.g. ' (1 = no accumulation)'
    optimizer_state: str = ""  # when a change reshapes the optimizer's state, e.g. 'switched between 0 and > 0'


@dataclasses.dataclass(frozen=True)
class Group:
    """A key's default when its value is a group of named entries, empty by default (config.base_config
    makes a fresh ConfigDict): `entry` names each entry's fields, () when an entry is one string. Set
    whole, in a config file or by its command-line shorthand (config.resolve); not by --config.KEY.NAME,
    since the names are the config's own."""
    entry: tuple = ()
    shorthand: str = ""  # the string key and value that config.resolve parses into the group


_SPECIAL_TOKENS = (
    "The pipeline's special ids (data/tokenizer.py): each document is packed as [bos] + ids + [eos] (no bos with "
    "data.add_bos=False); pad fills "
    "only positions masked out of the loss, so it may equal eos. '' = the tokenizer's own: a SentencePiece "
    "model's pieces; a tokenizer.json's declared bos/eos/pad, and a lone special token such as GPT-2's "
    "<|endoftext|> serves as all three. Else a token of its vocabulary, e.g. --config.data.pad_token='<pad>'. "
    "The resolved ids are part of the tokenizer's fingerprint (and travel into export bundles).")
_ALL_DEVICES = " (-1 = all devices the other axes leave)"
_SEED = " (a seed: a whole number from 0 to 2**63 - 1, what numpy's and JAX's generators both take)"

KEYS = (
    # model: the decoder
    Key("model.vocab_size", 0, STATE, "0: the tokenizer's size rounded up to a multiple of 128", ">= 0"),
    Key("model.d_model", 256, STATE, "model width", ">= 1"),
    Key("model.num_layers", 4, STATE, "decoder blocks", ">= 1"),
    Key("model.num_heads", 4, STATE, "attention heads", ">= 1"),
    Key("model.head_dim", 0, STATE, "0: d_model // num_heads", ">= 0"),
    Key("model.num_kv_heads", 0, STATE,
        "key/value heads (grouped-query attention: query head i reads key/value head i // (num_heads / "
        "num_kv_heads), as Hugging Face's Llama and Qwen3 do); must divide num_heads. 0 = num_heads (multi-head); "
        "1 = multi-query. The decode KV cache holds only these heads", ">= 0"),
    Key("model.qk_norm", False, STATE,
        "Qwen3's RMSNorm over each head's query and key (a learned scale of width head_dim, epsilon "
        "model.norm_eps), after the projections and before RoPE"),
    Key("model.norm_eps", 1e-5, STATE,
        "epsilon of every norm: the blocks', the final one and the q/k norms (Qwen3 1e-6; GPT-2, OLMo, Llama 3 1e-5)",
        "> 0"),
    Key("model.d_ff", 1024, STATE, "MLP hidden width (SwiGLU: use 2/3 of the GELU width for equal size)", ">= 1"),
    Key("model.max_seq_len", 128, STATE, "size of the learned position table (>= data.seq_len)", ">= 1"),
    Key("model.norm", "layernorm", STATE, "'layernorm' | 'rmsnorm' | 'nonparametric_layernorm'"),
    Key("model.mlp", "gelu", STATE, "'gelu' | 'swiglu'"),
    Key("model.position", "learned", STATE, "'learned' | 'rope'"),
    Key("model.rope_theta", 10000.0, STATE, "RoPE's base wavelength", "> 0"),
    Key("model.rope_scaling", "none", STATE,
        "RoPE's context extension (model/rope.py, Hugging Face's rope_type): 'none' | 'llama3' (Llama 3.1: slow "
        "frequencies divided by rope_scaling_factor, fast ones kept, a smooth band between) | 'yarn' (YaRN: a ramp "
        "between the two by dimension, and cos/sin times 0.1 ln(factor) + 1). Only with model.position='rope'"),
    Key("model.rope_scaling_factor", 1.0, STATE, "llama3, yarn: how many times the original context", "> 0"),
    Key("model.rope_low_freq_factor", 1.0, STATE,
        "llama3: wavelengths above rope_original_max_len / this are divided by the factor", "> 0"),
    Key("model.rope_high_freq_factor", 4.0, STATE,
        "llama3: wavelengths below rope_original_max_len / this are kept (must exceed rope_low_freq_factor)", "> 0"),
    Key("model.rope_original_max_len", 8192, STATE,
        "llama3, yarn: the context the checkpoint was pretrained at (Hugging Face's "
        "original_max_position_embeddings)", ">= 1"),
    Key("model.rope_beta_fast", 32.0, STATE, "yarn: dimensions turning more than this often over the original "
        "context keep their frequency", "> 0"),
    Key("model.rope_beta_slow", 1.0, STATE, "yarn: dimensions turning less than this often are interpolated", "> 0"),
    Key("model.use_bias", True, STATE, "biases in the blocks' Linear layers and norms"),
    Key("model.tie_embeddings", True, STATE, "the output head is the token table's transpose"),
    Key("model.init_std", 0.02, SETTING, "standard deviation of the initial weights", "> 0"),
    Key("model.dtype", "float32", SETTING, "compute dtype: 'float32' | 'bfloat16'"),
    Key("model.param_dtype", "float32", STATE, "master weights"),
    Key("model.embedding_multiplier", 1.0, STATE,
        "the decoder's input T(token) times this (not the tied head, not the f-gram model's input: "
        "scone.input_multiplier, not f-gram rows); 1 = the method. A control of docs/quality.md: the baseline "
        "with input rows near the f-gram rows' scale", "> 0"),
    Key("model.scan_layers", True, SETTING,
        "blocks as one scan over stacked parameters (compiles once); False: a Python loop of separate blocks, for "
        "debugging (same math; a checkpoint of the other layout is converted on restore)"),
    Key("model.remat", "none", SETTING,
        "what each block keeps for the backward pass; see model/remat.py: 'none' (everything) | 'full' (only its "
        "input) | 'save_dots' (matmul outputs without batch dims) | 'save_qkv_proj' (q/k/v/attention-output "
        "projections)"),
    Key("model.init_from_hf", "", SETTING,
        "a local Hugging Face checkpoint directory (config.json, safetensors weights, tokenizer.json) a fresh run "
        "starts from (hf/derive.py, docs/training.md): the model section is derived from its config.json (a "
        "different value set here is refused), data.tokenizer_path, the special tokens and data.add_bos from its "
        "tokenizer files, and the decoder's parameters are read from its weights instead of initialised; '' = "
        "random initialisation. A resume may change it (a moved directory): the checkpoint's state is what resumes. "
        "A SETTING, not LOOP: another checkpoint starts another experiment (the study's rows tell them apart)"),
    Key("model.attention", "auto", SETTING,
        "'auto' | 'xla' | 'cudnn' | 'splash' | 'reference'; see model/attention.py"),

    # scone: the f-gram model and its vocabulary
    Key("scone.enabled", False, STATE, "train the f-gram model jointly and replace embeddings at matches"),
    Key("scone.vocab_path", "", SETTING,
        "f-gram vocabulary; '' = extract into <workdir>/fgrams on first run (pinned on resume by its fingerprint, "
        "not its path)"),
    Key("scone.max_len", 5, STATE, "K: longest f-gram, in tokens", ">= 2"),
    Key("scone.num_fgrams", 100_000, STATE, "S: f-grams kept (top S by count, all lengths ranked together)", ">= 1"),
    Key("scone.min_count", 5, STATE, "extraction's minimum count from the second scan on", ">= 1"),
    Key("scone.extract_max_tokens", 50_000_000, STATE, "extraction reads at most this many training tokens", ">= 1"),
    Key("scone.fgram_capacity", 1024, SETTING, "U: unique f-grams per data shard per step (static shape; checked "
        "on a sample of the run's batches before the first step, training/capacity.py)", ">= 1"),
    Key("scone.num_layers", 4, STATE, "f-gram model depth (its size relative to the main model)", ">= 1"),
    Key("scone.d_model", 0, STATE, "f-gram model width; 0 = the main model's (else projected to it)", ">= 0"),
    Key("scone.num_heads", 0, STATE, "0 = the main model's", ">= 0"),
    Key("scone.d_ff", 0, STATE, "0 = the main model's", ">= 0"),
    Key("scone.output_gain_init", 0.0, STATE,
        "0 = off (the method); > 0: f-gram embeddings times a learned scalar gain that starts here (an experiment "
        "on their scale, docs/quality.md)"),
    Key("scone.input_multiplier", 1.0, STATE,
        "the f-gram model's input T(t_i) times this, before its position embeddings; 1 = the method. An experiment "
        "of docs/quality.md: model.embedding_multiplier's scaled input for the f-gram model's blocks too", "> 0"),
    Key("scone.output_norm", True, STATE,
        "the f-gram embedding is the hidden state after the f-gram model's final norm (docs/method.md §4); False: "
        "its last block's residual stream, at the scale of the token inputs it replaces (docs/quality.md: the "
        "final norm's rows collapse)"),
    Key("scone.learning_rate_multiplier", 1.0, STATE,
        "the f-gram model's parameters (model/roles.py) train at this multiple of the learning rate (its whole "
        "schedule; the decoder and the shared T keep the rate); 1 = the method. > 0; != 1 only with enabled "
        "(docs/training.md). A run trained at two ratios of the rates would be neither experiment's, so a resume "
        "may not change it", "> 0",
        " (the f-gram model's learning rate over train.learning_rate; 1 = the same)"),
    Key("scone.init_from_hf", "", SETTING,
        "a local Hugging Face checkpoint directory (Llama, Qwen3, GPT-2, OLMo; config.json, safetensors weights, "
        "tokenizer.json) whose blocks and final norm become the f-gram model (hf/fgram_source.py, docs/training.md "
        "'SCONE on a pretrained model'): scone.source_model, num_layers, d_model, num_heads and d_ff are derived from "
        "its config.json (a different value set here is refused), its weights are read at a fresh start, and its "
        "tokenizer must be the run's (same ids for the same tokens, else refused). Needs enabled and gate. '' = the "
        "f-gram model starts random. A resume may point it elsewhere (a moved directory); the checkpoint resumes"),
    Key("scone.source_model", "", STATE,
        "derived from scone.init_from_hf, not set by hand: the source checkpoint's architecture as a JSON object of "
        "model.* keys (norm, epsilon, MLP, biases, key/value heads, head_dim, q/k norm, positions and RoPE's "
        "settings, vocab_size), which the f-gram model's blocks take instead of the main model's; '' = the main "
        "model's block kind with learned positions over K (docs/method.md §4)"),
    Key("scone.own_token_embedding", False, STATE,
        "the f-gram model reads a token table of its own (the source checkpoint's embed_tokens with "
        "scone.init_from_hf, else random), not the main model's T through in_proj; a training-only parameter, "
        "nothing of it is exported. False = the method (T shared)"),
    Key("scone.max_source_params", 0, LOOP,
        "refuse a scone.init_from_hf source whose f-gram model (its blocks, final norm, own token table and the "
        "projections, as this run would build it) has more parameters than this; 0 = no bound. A guard checked "
        "before anything is read, set from what tools/aot_compile.py showed fits the slice", ">= 0"),
    Key("scone.gate_learning_rate_multiplier", 1.0, STATE,
        "scone.gate's g trains at this multiple of the f-gram model's rate (on top of learning_rate_multiplier): at "
        "a fine-tune's learning rate (4e-5) Adam moves g by about that per step, too slow to reach 1 in a run. "
        "Only with gate", "> 0"),
    Key("scone.combine", "replace", STATE,
        "a matched position's input from the f-gram embedding f: 'replace' = f (the method, docs/method.md §3); "
        "'add' = T(token) + f, the token's own input (model.embedding_multiplier included) kept beside it (with "
        "scone.gate: T(token) + g f). The export bakes it into the table's rows (docs/training.md). Only with "
        "enabled"),
    Key("scone.row_scale", "raw", STATE,
        "the f-gram embedding f as it enters: 'raw' (the method) or 'token_rms', f rescaled to the RMS of the "
        "token input it meets, f * rms(T(token)) / rms(f) (model.embedding_multiplier included; docs/training.md), "
        "so replaced and kept positions enter at one scale. Baked into the table's rows. Only with enabled"),
    Key("scone.output_ramp_steps", 0, STATE,
        "0 = off (the method). W > 0: a matched position's input ramps from the token's to the f-gram model's, "
        "(1 - r) T(token) + r f with r = min(1, step / W), r set by the train step (X-gram's output ramp; the f-gram "
        "model trains from step 1, an alternative to the hold-back train.fgram_model_delay_*). r is saved with the "
        "model and the export bakes the checkpoint's r into the rows (docs/training.md). Only with enabled", ">= 0"),
    Key("scone.output_projection_init", "normal", SETTING,
        "the f-gram model's projection to the main model's width (out_proj): 'normal' (model.init_std; only when "
        "the f-gram model's width differs) or 'zeros' (at any width), with which scone.combine='add' starts as the "
        "plain decoder exactly and f grows from 0 at the scale the projection learns (docs/training.md). 'zeros' "
        "needs combine='add' or scone.gate"),
    Key("scone.gate", False, STATE,
        "the method (False): a matched position's input is the f-gram embedding f. True: a learned scalar g, "
        "starting at 0, mixes it with the token's own input, (1 - g) T(token) + g f, so training starts as the "
        "baseline's and reaches the method's replacement at g = 1; the export bakes g into the table's rows "
        "(docs/training.md). Only with enabled"),

    # overencoding: the Over-Tokenized Transformer's hashed n-gram input embeddings, SCONE's baseline
    Key("overencoding.enabled", False, STATE,
        "Over-Encoding (Huang et al. 2025, docs/method.md §8): the decoder's input is the mean of T(token) and "
        "k(n-1) projected rows of hashed n-gram tables, ids computed on the host; not with scone.enabled"),
    Key("overencoding.n", 3, STATE, "n: n-grams of orders 2..n ending at each position", ">= 2"),
    Key("overencoding.k", 4, STATE,
        "k: tables per order, each with its own modulus; k(n-1) tables of width d_model / (k(n-1)), which must "
        "divide model.d_model", ">= 1"),
    Key("overencoding.m", 100_001, STATE,
        "m: the first table's modulus; table s (0-based, order-major) hashes modulo m + 2s and has that many rows "
        "plus the reserved 'no n-gram' row 0, about m x d_model parameters in all. Every modulus m + 2s must be "
        "coprime with model.vocab_size (the base of the ids)", ">= 2"),

    # engram: DeepSeek's Engram, hashed n-gram memory gated into the residual stream at early blocks
    Key("engram.enabled", False, STATE,
        "Engram (DeepSeek 2026, docs/method.md §9): before each block of engram.layers the residual stream gains the "
        "gated, convolved projection of (n-1) x heads hashed n-gram rows, ids computed on the host; not with "
        "scone.enabled or overencoding.enabled"),
    Key("engram.layers", "1", STATE,
        "the blocks (0-based, ascending, comma-separated) an Engram runs before, each with tables of its own; "
        "'1': before the second block (the paper's early layer)"),
    Key("engram.n", 3, STATE, "n: n-grams of orders 2..n ending at each position (the paper's 3)", ">= 2"),
    Key("engram.heads", 8, STATE, "K: hash heads (tables) per order, each with its own prime modulus (the paper's 8)",
        ">= 1"),
    Key("engram.head_width", 64, STATE,
        "width of one head's rows; the memory row e_t is (n-1) x heads x head_width wide", ">= 1"),
    Key("engram.rows", 100_000, STATE,
        "rows per head: the heads' moduli are the successive primes from here on, each used once over every head "
        "of every layer; about layers x (n-1) x heads x rows x head_width table parameters", ">= 2"),
    Key("engram.kernel_size", 4, STATE, "the causal depthwise convolution's taps (the paper's 4)", ">= 1"),
    Key("engram.dilation", 0, STATE, "the convolution's dilation; 0 = engram.n (the paper's max n-gram order)",
        ">= 0"),
    Key("engram.compress_tokens", True, STATE,
        "the paper's tokenizer compression: tokens whose texts normalise alike (NFKC, no accents, lower case, "
        "whitespace collapsed and trimmed) are one token to the hash (data/engram_hash.py)"),
    Key("engram.seed", 0, STATE, "seed of the hash's odd multipliers (data/engram_hash.py), per layer", ">= 0"),
    Key("engram.init_std", 0.0, SETTING,
        "standard deviation of the tables' initial rows; 0 = model.init_std, as T's rows (1: PyTorch's nn.Embedding "
        "default, which DeepSeek's demo inherits)", ">= 0"),

    # data: corpus, tokenizer, batches
    Key("data.source", "kjv", STATE,
        "'kjv' (embedded corpus) | 'text' | 'jsonl' | 'arrayrecord' | 'chat' (conversations: JSONL of messages, or "
        "their shards from tools/pretokenize.py --format=chat; docs/data.md 'Conversations')"),
    Key("data.train_files", "", STATE,
        "glob pattern(s), comma-separated; or the shorthand of data.mixture, "
        "'web=/d/web/*.jsonl@0.7;books=/d/books/*.jsonl.gz@0.3', which config.resolve parses into it (leaving "
        "this '')"),
    Key("data.mixture", Group(("files", "weight", "order"), "data.train_files='web=/d/web/*.jsonl@0.7;books=/d/b/*.txt@0.3'"),
        STATE,
        "a training mixture (data/mixture.py): component name -> {files: comma-separated globs, weight: relative "
        "share of rows, order: its place, 0, 1, ... (the schedule and each component's shuffle follow it)}; empty = "
        "data.train_files alone"),
    Key("data.eval_files", "", LOOP,
        "held-out data: globs; or the shorthand of data.eval_sets, 'web=/d/web/*.jsonl;books=/d/b/*.txt', which "
        "config.resolve parses into it (leaving this ''); '' with kjv and no sets = its built-in held-out split"),
    Key("data.eval_sets", Group((), "data.eval_files='web=/d/web/*.jsonl;books=/d/b/*.txt'"), LOOP,
        "named held-out sets (data/eval_sets.py): set name -> comma-separated globs, each evaluated on its own, in "
        "name order, with their average; empty = data.eval_files alone"),
    Key("data.text_field", "text", STATE, "jsonl field holding the document"),
    Key("data.document_unit", "line", STATE, "text files: one document per 'line' or per 'file'"),
    Key("data.messages_field", "messages", STATE, "chat: the JSONL field holding a conversation's list of "
        "{role, content} messages (roles system, user, assistant)"),
    Key("data.chat_template", "", STATE,
        "chat: the jinja2 chat template: a .jinja file, a tokenizer_config.json or a checkpoint directory; '' = "
        "chat_template.jinja or tokenizer_config.json beside data.tokenizer_path (data/chat_template.py)"),
    Key("data.loss_on", "assistant", STATE,
        "chat: the tokens trained on, 'assistant' (each reply's tokens and its end-of-turn token; "
        "data/conversations.py) or 'all' (every token of the rendered conversation, as open-r1 trains). Held-out "
        "loss and perplexity count the same tokens"),
    Key("data.overlong", "refuse", STATE,
        "chat: a conversation longer than a row (data.seq_len positions) is 'refuse'd (the run stops before "
        "training, naming it and the count) or 'truncate'd to its first data.seq_len positions (the count logged "
        "once); rows hold whole conversations, never one split"),
    Key("data.eval_fraction", 0.02, STATE, "kjv: fraction of documents held out", "in (0, 1)"),
    Key("data.tokenizer_path", "", SETTING,
        "a SentencePiece .model or a Hugging Face tokenizer.json (local or gs://; the kind is read from the "
        "content); '' = train a SentencePiece model into <workdir>/tokenizer.model (pinned on resume by its "
        "fingerprint, not its path)"),
    Key("data.vocab_size", 8000, SETTING, "only used to train the tokenizer", ">= 1"),
    Key("data.tokenizer_size", 0, SETTING,
        "0: any tokenizer of at most model.vocab_size tokens; else the exact number of tokens (added tokens "
        "included) the tokenizer must have: paper configs pin their tokenizers", ">= 0",
        " (0 = any tokenizer that fits model.vocab_size)"),
    Key("data.character_coverage", 0.9995, SETTING,
        "tokenizer training: share of the text's characters that get pieces of their own; the rest are spelled in "
        "bytes (lossless). Lower it for small vocabularies over many scripts (2,048 pieces over text with CJK "
        "passages: 0.99)", "in (0, 1]"),
    Key("data.bos_token", "", SETTING, _SPECIAL_TOKENS),
    Key("data.eos_token", "", SETTING, "see data.bos_token"),
    Key("data.pad_token", "", SETTING, "see data.bos_token"),
    Key("data.add_bos", True, STATE,
        "each document is read as [bos] + ids (inputs) with targets ids + [eos]; False: its ids alone, inputs "
        "t_1..t_n and targets t_2..t_n, eos (n positions, not n + 1), as models without a bos (Qwen) were trained. "
        "Training and held-out batches, f-gram extraction's counts and every served prompt follow it (data/prompt.py; "
        "serving reads it from the bundle)"),
    Key("data.seq_len", 128, STATE, "tokens per row", ">= 1"),
    Key("data.global_batch_size", 16, STATE, "rows per step over all processes", ">= 1"),
    Key("data.shuffle_seed", 0, STATE, "the order of documents and of a mixture's rows", "in [0, 2**63)", _SEED),
    Key("data.worker_count", -1, LOOP,
        "processes building batches: -1 = half the host's cores (1..16); 0 = a thread of the training process. "
        "Batches do not depend on it (data/packing.py).", ">= -1",
        " (-1 = half the cores, 0 = a thread of the training process)"),
    Key("data.prefetch_buffer", 8, LOOP, "batches each worker (or the builder thread) keeps ready", ">= 1"),

    # train: optimizer, schedule and the loop
    Key("train.seed", 0, SETTING, "parameter initialisation", "in [0, 2**63)", _SEED),
    Key("train.num_steps", 1000, SETTING, "steps of the whole run (the learning-rate schedule's length)", ">= 1"),
    Key("train.max_steps_per_run", 0, LOOP,
        "stop this invocation after so many steps (0 = no limit); rerun resumes", ">= 0"),
    Key("train.learning_rate", 1e-3, SETTING, "peak learning rate", "> 0"),
    Key("train.warmup_steps", 100, SETTING, "linear warm-up", ">= 0"),
    Key("train.min_lr_ratio", 0.1, SETTING, "cosine decays to learning_rate * min_lr_ratio", "in [0, 1]"),
    Key("train.weight_decay", 0.1, SETTING,
        "AdamW, decoupled; on weight matrices only (every Linear kernel, an untied head included), never on "
        "embeddings, norms or biases (model/roles.py)", ">= 0"),
    Key("train.b1", 0.9, SETTING, "AdamW's first-moment decay", "in [0, 1)"),
    Key("train.b2", 0.95, SETTING, "AdamW's second-moment decay", "in [0, 1)"),
    Key("train.eps", 1e-8, SETTING, "AdamW's epsilon", "> 0"),
    Key("train.grad_clip_norm", 1.0, SETTING, "0 disables clipping", ">= 0"),
    Key("train.fgram_model_delay_steps", 0, SETTING,
        "SCONE: the f-gram model's updates are 0 for steps 1..D (D = this), then ramp linearly, D+k getting k/D, "
        "to full from step 2D on (0 = the method's joint training from step 1; docs/training.md). Switching "
        "between 0 and > 0 on resume is refused.", ">= 0", optimizer_state="switched between 0 and > 0"),
    Key("train.fgram_model_delay_steps_per_layer", 0, SETTING,
        "the same delay scaled with the f-gram model's depth: D = this x scone.num_layers (so 20 gives a 1-, 2-, "
        "4-block f-gram model D = 20, 40, 80); 0 = off. At most one of the three delay keys may be > 0.", ">= 0",
        optimizer_state="switched between 0 and > 0"),
    Key("train.fgram_model_delay_fraction", 0.0, SETTING,
        "the same delay as a share of the run: D = ceil(this x train.num_steps) (0.065 gives 80 of 1,221 steps and "
        "24 of 367), so one setting holds back the same part of a short and a long run; 0 = off. At most one of "
        "the three delay keys may be > 0.", "in [0, 1)", optimizer_state="switched between 0 and > 0"),
    Key("train.grad_accum_steps", 1, SETTING,
        "micro-batches per step; must divide the rows per data shard (and, with SCONE, scone.fgram_capacity, which "
        "is split evenly across micro-batches)", ">= 1", " (1 = no accumulation)"),
    Key("train.log_every", 10, LOOP, "steps between log lines", ">= 1", " (steps between log lines)"),
    Key("train.eval_every", 100, LOOP, "0 disables periodic evaluation", ">= 0"),
    Key("train.eval_batches", 0, LOOP, "0 = the whole held-out set", ">= 0"),
    Key("train.checkpoint_every", 100, LOOP, "steps between checkpoints", ">= 1",
        " (steps between checkpoints; the last step is always saved)"),
    Key("train.keep_checkpoints", 3, LOOP, "checkpoints kept", ">= 1",
        " (the number of checkpoints kept; a run must never end without one)"),
    Key("train.peak_flops_per_device", 0.0, LOOP, "for MFU; 0 = look up the device kind (CPU: measured)", ">= 0"),
    Key("train.profile_steps", "", LOOP,
        "'START:END': a jax.profiler trace of those steps into <workdir>/profile (training/profile.py)"),
    Key("train.profile_all_processes", False, LOOP, "trace on every process, not only process 0"),
    Key("train.compilation_cache_dir", "compilation_cache", LOOP,
        "JAX's persistent compilation cache, so a restart loads the compiled steps (and the traced train step, "
        "training/exported_step.py): relative = inside the workdir, absolute or gs:// as is, '' = off "
        "(runtime/compile_cache.py)"),

    # mesh: the device mesh's axes
    Key("mesh.data", -1, SETTING, "-1: all devices not used by the other axes", "-1 | >= 1", _ALL_DEVICES),
    Key("mesh.fsdp", 1, SETTING, "parameters and optimizer state sharded over this axis", "-1 | >= 1", _ALL_DEVICES),
    Key("mesh.tensor", 1, SETTING, "tensor parallelism", "-1 | >= 1", _ALL_DEVICES),
)

BY_NAME = {key.name: key for key in KEYS}
# Numeric keys and the values they accept; config.validate names the key and the rule when one is broken.
NUMERIC_RULES = {key.name: key.rule for key in KEYS if key.rule}
RULE_HINTS = {key.name: key.hint for key in KEYS if key.hint}
# What a checkpoint's state and the batches after it mean: resuming with another value of any of these is refused
# (training/train.py), unless named in --allow_config_change.
RESUME_KEYS = tuple(key.name for key in KEYS if not key.role.resume)
# What the exported train step's key leaves out (training/exported_step.py): a resume that changes them still
# loads the traced program.
LOOP_ONLY_KEYS = tuple(key.name for key in KEYS if not key.role.program)
# Keys whose value is a group of named entries, set whole (config.resolve, and stored configs in serving/bundle.py).
GROUPS = tuple(key.name for key in KEYS if isinstance(key.default, Group))
# Keys whose change reshapes the optimizer's state: a checkpoint saved before such a change does not fit.
OPTIMIZER_STATE_KEYS = tuple(key.name for key in KEYS if key.optimizer_state)


def optimizer_state_fix() -> str:
    """What to resume with when a checkpoint's optimizer state has other arrays than this config builds
    (training/checkpoint.py): the settings it was saved with, naming the keys that reshape that state."""
    conditions: dict[str, list[str]] = {}
    for name in OPTIMIZER_STATE_KEYS:
        conditions.setdefault(BY_NAME[name].optimizer_state, []).append(name)
    changes = "; ".join(f"{' or '.join(names)} {condition}" for condition, names in conditions.items())
    return f"the optimizer settings the checkpoint was saved with ({changes} changes the optimizer's state)"
