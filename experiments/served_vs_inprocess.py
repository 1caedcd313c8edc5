"""The same model and decoder in-process and served (issue 55 item 8): the server's overhead.

SmolLM2-135M-Instruct, greedy, the same MT-Bench prompts, measured by ``mtad-energy compare``:

* **llama.cpp**: ``--engine llamacpp`` (the Q4_1 GGUF in-process, one thread) against
  ``python -m llama_cpp.server`` on the same GGUF and thread count, measured as
  ``--engine http://127.0.0.1:PORT`` (text prompts; its tokens counted from per-token logprobs,
  which need the server's default ``logits_all``: it streams no token ids). A third reading
  splits the server's overhead: the same server without ``logits_all``, its stream read here
  without logprobs (one token per streamed chunk, as llama_cpp.server streams them: the tool
  itself never counts tokens that way).
* **vLLM-CPU**: ``--engine vllm`` (ar, and pld = vLLM's n-gram speculation, 4 tokens) against
  vLLM's OpenAI server started plain and with ``--speculative-config`` n-gram (the same
  configuration), measured as ``--engine http://...`` (token-id prompts, its streamed ids).

Per row: tokens/s (the decode window's: decode tokens / decode seconds), time to first token
(``prefill_time_s``), mean inter-token time in the decode window (``decode_time_s /
decode_tokens``), J/token where the meter measures energy (``--meter auto``: none on a machine
without RAPL or NVML, said in the table), acceptance, and whether the row was measured while
other processes used the machine (``contended``).

    export PYTHONPATH=$PWD OMP_NUM_THREADS=1 VLLM_CPU_KVCACHE_SPACE=1
    PY=/work/ci-engines/.venv-engines/bin/python   # vllm-cpu, llama-cpp-python[server]
    $PY experiments/served_vs_inprocess.py llamacpp
    flock /tmp/vllm.lock timeout 1500 $PY experiments/served_vs_inprocess.py vllm
    $PY experiments/served_vs_inprocess.py table

Writes experiments/results/served/{llamacpp,vllm}_rows.csv (one row per prompt and setting),
served.md and served.json (the medians, the commands, the versions).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

from mtad_energy.engines.server_protocol import Stream, read_stream
from mtad_energy.results import ResultStore
from tests.engines.real_servers import NGRAM, llamacpp_command, running, vllm_command, vllm_env

OUT = Path(__file__).resolve().parent / "results" / "served"
CLI = [sys.executable, "-c", "from mtad_energy.cli import app; app()"]
COLUMNS = ["family", "setting", "where", "decoder", "prompt_id", "prompt_len", "tokens",
           "tokens_per_s", "ttft_s", "itl_s", "energy_per_token_j", "meter", "acceptance_rate",
           "contended", "others_cores"]


def compare(engine: str, store: Path, args: argparse.Namespace, *extra: str) -> str:
    """Run ``compare`` (a process of its own) into ``store`` (a temporary folder: the rows
    this experiment keeps are its CSVs); its command line."""
    cmd = [*CLI, "compare", "--engine", engine, "--model", "smollm2", "--dataset", args.dataset,
           "--n-prompts", str(args.n_prompts), "--max-new-tokens", str(args.max_new_tokens),
           "--set", "temperature=0", "--device", "cpu", "--meter", "auto",
           "--output", str(store), *extra]
    print("$", " ".join(cmd[3:]), flush=True)
    subprocess.run(cmd, check=True, stdout=sys.stderr)
    return " ".join(["mtad-energy", *cmd[3:]]).replace(str(store.parent), "$TMP")


def store_rows(store: Path, family: str, setting: str, where: str) -> pd.DataFrame:
    """One line per stored row: the figures this experiment compares."""
    runs = ResultStore(store).load("runs")
    out = pd.DataFrame({
        "family": family, "setting": setting, "where": where, "decoder": runs["decoder"],
        "prompt_id": runs["prompt_id"], "prompt_len": runs["prompt_len"],
        "tokens": runs["tokens_emitted"], "tokens_per_s": runs["tokens_per_s"],
        "ttft_s": runs["prefill_time_s"],
        "itl_s": runs["decode_time_s"] / runs["decode_tokens"].where(runs["decode_tokens"] > 0),
        "energy_per_token_j": runs["energy_per_token_j"], "meter": runs["meter"],
        "acceptance_rate": runs["acceptance_rate"], "contended": runs["contended"],
        "others_cores": runs["others_cores"]})
    return out[COLUMNS]


def prompt_texts(args: argparse.Namespace) -> list[tuple[str, int, str]]:
    """(prompt id, its length in tokens, its text) as the tool sends a prompt to a server that
    takes text: the dataset's prompt through the target's chat template (`text_ids`), decoded."""
    from transformers import AutoTokenizer

    from mtad_energy.bench.prompts import load_prompts
    from mtad_energy.decoding.runtime.generate import text_ids
    from mtad_energy.models import smollm2_dir

    tok = AutoTokenizer.from_pretrained(smollm2_dir())
    out = []
    for p in load_prompts(args.dataset, args.n_prompts):
        ids = text_ids(tok, p.text)
        out.append((p.id, len(ids), tok.decode(ids, skip_special_tokens=False)))
    return out


def raw_stream_rows(url: str, pid: int, prompts: list[tuple[str, int, str]],
                    args: argparse.Namespace) -> pd.DataFrame:
    """The server read without logprobs: each request alone, tokens = streamed chunks (one
    token each on llama_cpp.server); TTFT and mean inter-chunk time as the tool defines them,
    and what other processes took meanwhile (the server's process counted as this one's)."""
    from mtad_energy.measure.contention import ContentionProbe

    probe, lines = ContentionProbe(), []
    for pid_, n_prompt, text in [prompts[0], *prompts]:  # the first one twice: a warm-up
        body = {"prompt": text, "max_tokens": args.max_new_tokens, "temperature": 0.0,
                "stream": True}
        stream = Stream()
        probe.begin("raw", own=(pid,))
        t0 = time.perf_counter()
        read_stream(url, body, 600, stream)
        busy = probe.end("raw")
        if stream.error is not None:
            raise stream.error
        times = [c.t for c in stream.chunks]
        n = len(times)
        lines.append({"family": "llama.cpp", "setting": "served, no logprobs", "where": "served",
                      "decoder": "ar", "prompt_id": pid_, "prompt_len": n_prompt, "tokens": n,
                      # the decode window's rate, as the tool's tokens_per_s
                      "tokens_per_s": (n - 1) / (times[-1] - times[0]) if n > 1 else None,
                      "ttft_s": times[0] - t0,
                      "itl_s": (times[-1] - times[0]) / (n - 1) if n > 1 else None,
                      "energy_per_token_j": None, "meter": "none", "acceptance_rate": None,
                      "contended": None if busy is None else busy.contended,
                      "others_cores": None if busy is None else busy.others_cores})
    return pd.DataFrame(lines[1:], columns=COLUMNS)


def medians(rows: pd.DataFrame) -> pd.DataFrame:
    """Per family, setting and decoder: the medians over prompts, and the server's overhead
    against the in-process row of the same family and decoder (inter-token time served minus
    in-process, in ms and as a ratio; TTFT the same)."""
    rows = rows.assign(base=rows["decoder"].str.split().str[0])
    keys = ["family", "setting", "decoder", "base", "where"]
    med = rows.groupby(keys, sort=False).agg(
        prompts=("prompt_id", "size"), tokens_per_s=("tokens_per_s", "median"),
        ttft_s=("ttft_s", "median"), itl_s=("itl_s", "median"),
        energy_per_token_j=("energy_per_token_j", "median"),
        acceptance_rate=("acceptance_rate", "median"),
        contended=("contended", lambda c: int(c.fillna(False).astype(bool).sum())),
        meter=("meter", "first")).reset_index()
    base = med[med["where"] == "in-process"].set_index(["family", "base"])
    ref = base.reindex(pd.MultiIndex.from_frame(med[["family", "base"]]))
    med["itl_overhead_ms"] = 1e3 * (med["itl_s"].to_numpy() - ref["itl_s"].to_numpy())
    med["itl_ratio"] = med["itl_s"].to_numpy() / ref["itl_s"].to_numpy()
    med["ttft_overhead_ms"] = 1e3 * (med["ttft_s"].to_numpy() - ref["ttft_s"].to_numpy())
    return med.drop(columns=["base"])


def _fmt(value, spec: str) -> str:
    return "-" if value is None or pd.isna(value) else format(value, spec)


def write_table(meta: dict) -> None:
    """served.md: one line per family, setting and decoder (the medians and the overhead)."""
    frames = [pd.read_csv(OUT / f"{w}_rows.csv") for w in ("llamacpp", "vllm")
              if (OUT / f"{w}_rows.csv").is_file()]
    if not frames:
        return
    med = medians(pd.concat(frames, ignore_index=True))
    med.to_csv(OUT / "served_medians.csv", index=False)
    lines = ["| engine | setting | decoder | prompts | tokens/s | TTFT (s) | inter-token (ms) | "
             "overhead/token (ms) | x in-process | J/token | acceptance | contended |",
             "|---|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for r in med.itertuples():
        energy = (_fmt(r.energy_per_token_j, ".4f") if not pd.isna(r.energy_per_token_j)
                  else f"n/a ({r.meter})")
        lines.append(f"| {r.family} | {r.setting} | {r.decoder} | {r.prompts} | "
                     f"{_fmt(r.tokens_per_s, '.1f')} | {_fmt(r.ttft_s, '.3f')} | "
                     f"{_fmt(1e3 * r.itl_s, '.1f')} | {_fmt(r.itl_overhead_ms, '+.1f')} | "
                     f"{_fmt(r.itl_ratio, '.2f')} | {energy} | {_fmt(r.acceptance_rate, '.2f')} | "
                     f"{r.contended}/{r.prompts} |")
    (OUT / "served.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def shown(command: list[str]) -> str:
    """A server's command line as run (port 0 shown as PORT)."""
    return " ".join(command).replace("--port 0", "--port PORT")


def run_llamacpp(args: argparse.Namespace, work: Path) -> dict:
    """In-process llama.cpp, its server as the tool reads it, and its server read raw."""
    threads = ["--engine-option", f"n_threads={args.threads}"]
    commands = [compare("llamacpp", work / "inproc", args, "--decoders", "ar", *threads)]
    parts = [store_rows(work / "inproc", "llama.cpp", "in-process", "in-process")]
    with running(lambda port: llamacpp_command(port, args.threads), work / "llama.log") as (url, _):
        commands.append(compare(url, work / "served", args, "--decoders", "ar",
                                "--engine-option", "prompt=text,logprobs=true"))
    parts.append(store_rows(work / "served", "llama.cpp", "served (logprobs, logits_all)",
                            "served"))
    with running(lambda port: llamacpp_command(port, args.threads, logits_all=False),
                 work / "llama-raw.log") as (url, pid):
        parts.append(raw_stream_rows(url, pid, prompt_texts(args), args))
    pd.concat(parts).to_csv(OUT / "llamacpp_rows.csv", index=False)
    return {"commands": commands + ["(raw) POST /v1/completions stream, no logprobs, "
                                    "llama_cpp.server --logits_all False"],
            "servers": [shown(llamacpp_command(0, args.threads)),
                        shown(llamacpp_command(0, args.threads, logits_all=False))]}


def run_vllm(args: argparse.Namespace, work: Path) -> dict:
    """In-process vLLM (ar and n-gram pld) against its server, plain and n-gram."""
    opts = ["--engine-option", "dtype=float32"]
    commands = [compare("vllm", work / "inproc", args, "--decoders", "ar,pld",
                        "--set", f"pld.gamma={NGRAM['num_speculative_tokens']}", *opts)]
    parts = [store_rows(work / "inproc", "vLLM-CPU", "in-process", "in-process")]
    for name, spec in (("served", None), ("served, n-gram", NGRAM)):
        store = work / name.replace(", ", "-")
        with running(lambda port, spec=spec: vllm_command(port, spec), work / f"{store.name}.log",
                     start_s=600, env=vllm_env()) as (url, _):
            commands.append(compare(url, store, args, "--decoders", "ar"))
        rows = store_rows(store, "vLLM-CPU", name, "served")
        rows["decoder"] = "pld (server's n-gram)" if spec else "ar"
        parts.append(rows)
    pd.concat(parts).to_csv(OUT / "vllm_rows.csv", index=False)
    return {"commands": commands, "speculative_config": NGRAM,
            "servers": [shown(vllm_command(0, spec)) for spec in (None, NGRAM)]}


def versions() -> dict:
    import importlib.metadata as md

    out = {}
    for dist in ("vllm-cpu", "llama_cpp_python", "torch", "transformers"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["llamacpp", "vllm", "table"])
    ap.add_argument("--dataset", default="mtbench")
    ap.add_argument("--n-prompts", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    meta_path = OUT / "served.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    if args.what != "table":
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            run = run_llamacpp if args.what == "llamacpp" else run_vllm
            info = run(args, Path(tmp))
        meta[args.what] = {**info, "args": vars(args), "versions": versions(),
                           "wall_s": round(time.perf_counter() - t0, 1),
                           "load_avg_end": os.getloadavg(), "cores": os.cpu_count()}
        meta_path.write_text(json.dumps(meta, indent=2, default=str) + "\n")
    write_table(meta)


if __name__ == "__main__":
    main()
