"""``boostlr prepare`` at pre-training scale: wall time, MB/s, tokens/s, peak RSS, cores used.

``make-corpus`` writes about ``--mb`` MB of text under ``--out``: copies of the running
Python's standard-library sources, each copy with its own renaming of common identifiers
(so the copies are not byte-identical), as a directory of ``.txt`` files (one document
each), as ``.jsonl`` files (one document per line) and as one big ``one/corpus.txt`` (the
documents joined by blank lines; prepare reads it in 256 KiB pieces). ``run`` runs
``boostlr prepare`` as a child process and samples the RSS of its whole process tree (the
sum, every 0.2 s) for the peak; cores used is the tree's CPU time over wall time, and per
phase (scan, tokenizer, merges, encode, and encode's read/tokenise/write threads) it is
the process CPU time over the phase's wall time that prepare itself records (``--stats``).
``raw`` times
``Tokenizer.encode_batch`` (``--fast``: ``encode_batch_fast``, which prepare uses) alone, in
this process, on the same documents (read beforehand, in batches of about 16 MB, only the
encode calls timed): the ceiling prepare is held to.

    python benchmarks/prepare_scale.py make-corpus --out /tmp/corpus --mb 1024
    python benchmarks/prepare_scale.py raw --corpus /tmp/corpus --tokenizer tok.json
    python benchmarks/prepare_scale.py run --corpus /tmp/corpus --input jsonl --tokenizer tok.json
    python benchmarks/prepare_scale.py run --corpus /tmp/corpus --input one --tokenizer bpe:32000
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import resource
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path

MB = 1e6
_RENAMED = ("self", "name", "value", "result", "data", "path", "args", "line", "text", "key")
_WORD = re.compile(r"\b(" + "|".join(_RENAMED) + r")\b")


def make_corpus(out: Path, mb: int) -> None:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    sources = [p for p in sorted(stdlib.rglob("*.py")) if "site-packages" not in p.parts]
    texts = []
    for p in sources:
        try:
            texts.append(p.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError):
            continue
    (out / "txt").mkdir(parents=True)
    (out / "jsonl").mkdir()
    (out / "one").mkdir()
    one = open(out / "one" / "corpus.txt", "w", encoding="utf-8")
    target, written, copy = mb * MB, 0, 0
    jsonl = None
    while written < target:
        rng = random.Random(copy)
        suffix = {w: f"{w}_{rng.randrange(1000)}" for w in _RENAMED}
        folder = out / "txt" / f"{copy:04d}"
        folder.mkdir()
        if copy % 16 == 0:
            if jsonl is not None:
                jsonl.close()
            jsonl = open(out / "jsonl" / f"part_{copy // 16:03d}.jsonl", "w", encoding="utf-8")
        for i, text in enumerate(texts):
            doc = _WORD.sub(lambda m: suffix[m.group(1)], text)  # noqa: B023
            (folder / f"{i:05d}.txt").write_text(doc, encoding="utf-8")
            jsonl.write(json.dumps({"text": doc}) + "\n")
            one.write(doc + "\n\n")
            written += len(doc.encode("utf-8"))
            if written >= target:
                break
        copy += 1
    jsonl.close()
    one.close()
    print(f"wrote {written / MB:.0f} MB of text in {copy} copies to {out}/txt, jsonl and one")


def _jsonl_docs(corpus: Path):
    for file in sorted((corpus / "jsonl").glob("*.jsonl")):
        with open(file, encoding="utf-8") as fh:
            for line in fh:
                yield json.loads(line)["text"]


def raw(corpus: Path, tokenizer: str, fast: bool) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer)
    encode_s = 0.0
    n_bytes = n_tokens = 0
    batch: list[str] = []
    size = 0

    cpu_s = 0.0

    def flush() -> None:
        nonlocal encode_s, cpu_s, n_tokens
        t0, c0 = time.perf_counter(), _self_cpu()
        encode = tok.encode_batch_fast if fast else tok.encode_batch
        encodings = encode(batch, add_special_tokens=False)
        encode_s += time.perf_counter() - t0
        cpu_s += _self_cpu() - c0
        n_tokens += sum(len(e.ids) for e in encodings)

    for doc in _jsonl_docs(corpus):
        batch.append(doc)
        size += len(doc)
        n_bytes += len(doc.encode("utf-8"))
        if size >= 16_000_000:
            flush()
            batch, size = [], 0
    if batch:
        flush()
    print(
        json.dumps(
            {
                "what": "raw encode_batch_fast" if fast else "raw encode_batch",
                "tokenizer": tokenizer,
                "MB": n_bytes / MB,
                "tokens": n_tokens,
                "encode_s": encode_s,
                "MB_per_s": n_bytes / MB / encode_s,
                "tokens_per_s": n_tokens / encode_s,
                "cores_used": cpu_s / encode_s,
                "cpu_s_per_MB": cpu_s / (n_bytes / MB),
            }
        )
    )


def _self_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            with open(f"/proc/{p}/task/{p}/children") as fh:
                todo.extend(int(c) for c in fh.read().split())
        except OSError:
            pass
    return out


def _rss_and_cpu(pids: list[int]) -> tuple[int, float]:
    rss, cpu = 0, 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for p in pids:
        try:
            with open(f"/proc/{p}/statm") as fh:
                rss += int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            with open(f"/proc/{p}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
                cpu += (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            pass
    return rss, cpu


def run(corpus: Path, kind: str, tokenizer: str, out: Path | None, keep: bool) -> None:
    out = out or Path(tempfile.mkdtemp(prefix="prepare-bench-")) / "data"
    cmd = [sys.executable, "-m", "boostlr.cli", "prepare", "--input", str(corpus / kind)]
    stats = out.parent / f".{out.name}-stats.json"
    cmd += ["--out", str(out), "--tokenizer", tokenizer, "--val-fraction", "0.001"]
    cmd += ["--stats", str(stats)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    peak, cpu_seen = 0, {}
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not stop.is_set():
            pids = _tree(proc.pid)
            rss, _ = _rss_and_cpu(pids)
            for p in pids:  # CPU of processes that exit before the end is kept
                cpu_seen[p] = _rss_and_cpu([p])[1] or cpu_seen.get(p, 0.0)
            peak = max(peak, rss)
            stop.wait(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    stdout, _ = proc.communicate()
    wall = time.perf_counter() - t0
    stop.set()
    sampler.join()
    child = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = max(child.ru_utime + child.ru_stime, sum(cpu_seen.values()))
    manifest = json.loads((out / "manifest.json").read_text())
    phases = json.loads(stats.read_text())
    stats.unlink()
    tokens = sum(s["tokens"] for s in manifest["splits"].values())
    n_bytes = sum(f.stat().st_size for f in (corpus / kind).rglob("*") if f.is_file())
    print(stdout.strip(), file=sys.stderr)
    print(
        json.dumps(
            {
                "what": f"boostlr prepare {kind}",
                "tokenizer": tokenizer,
                "input_MB": n_bytes / MB,
                "tokens": tokens,
                "wall_s": wall,
                "MB_per_s": n_bytes / MB / wall,
                "tokens_per_s": tokens / wall,
                "peak_rss_MB": peak / MB,
                "cores_used": cpu / wall,
                "cpu_s_per_MB": cpu / (n_bytes / MB),
                "returncode": proc.returncode,
                "phases": phases,
            }
        )
    )
    _phase_table(phases)
    if not keep:
        shutil.rmtree(out.parent if out.name == "data" else out, ignore_errors=True)


def _phase_table(phases: list[dict]) -> None:
    """Per phase: wall time, MB/s of the text it read, cores used (and by which threads)."""
    print(f"{'phase':<10} {'wall s':>8} {'MB/s':>7} {'cores':>6}  threads' cores")
    for p in phases:
        rate = f"{p['bytes'] / MB / p['wall_s']:7.2f}" if p["bytes"] and p["wall_s"] else " " * 7
        stages = ", ".join(f"{k} {v:.2f}" for k, v in p["stage_cores"].items())
        print(f"{p['phase']:<10} {p['wall_s']:8.1f} {rate} {p['cores']:6.2f}  {stages}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make-corpus")
    m.add_argument("--out", type=Path, required=True)
    m.add_argument("--mb", type=int, default=1024)
    r = sub.add_parser("raw")
    r.add_argument("--corpus", type=Path, required=True)
    r.add_argument("--tokenizer", required=True)
    r.add_argument("--fast", action="store_true", help="encode_batch_fast (no offsets)")
    p = sub.add_parser("run")
    p.add_argument("--corpus", type=Path, required=True)
    p.add_argument("--input", choices=("txt", "jsonl", "one"), required=True)
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--keep", action="store_true", help="keep the prepared dataset")
    args = parser.parse_args()
    if args.cmd == "make-corpus":
        make_corpus(args.out, args.mb)
    elif args.cmd == "raw":
        raw(args.corpus, args.tokenizer, args.fast)
    else:
        run(args.corpus, args.input, args.tokenizer, args.out, args.keep)


if __name__ == "__main__":
    main()
