"""Benchmark `data/prepare.py --tokenizer gpt2` against tiktoken's own batch encoding, and BPE training;
with `--formats`, the same text prepared from .txt, .jsonl, .jsonl.gz and .parquet.

    python bench/bench_prepare.py                       # 100 MB and 200 MB corpora, ~1-2 minutes on 2 cores
    python bench/bench_prepare.py --sizes 100,400 --shared ../shared/data
    python bench/bench_prepare.py --formats --sizes 100,300   # record files vs the same text as .txt

`--formats`: the sources cut into documents of about 4 KB (at blank lines), written once as one .txt
file (documents separated by a blank line) and as rows of a .jsonl, a .jsonl.gz and a .parquet (row
groups of 1000 rows, pyarrow's default compression) file; each prepared in its own process, three times,
the formats interleaved. Throughput is text MB (the documents' UTF-8 bytes) per second of prepare's own
timing (the median of the three), and tokens per second;
peak memory the process's maximum RSS (bounded for Parquet: it reads a batch at a time). Writes
bench/results/prepare_formats.json and prints a table.

Builds each corpus in a temporary directory as a folder of documents (copies of tiny-shakespeare and
WikiText-2 valid/test, about 1.1 MB each), then runs, each in its own process so peak memory is its own:
- ours: `python data/prepare.py CORPUS --out TMP --tokenizer gpt2 --quiet` (reads, decodes, encodes,
  writes and hashes); throughput from prepare's own timing (the summary line) and from the process
  wall clock (which adds interpreter start-up and importing torch);
- tiktoken: `encode_ordinary_batch(texts, num_threads=cores)` on the same documents already in memory
  (no reading, no writing), timed around that one call; at the first size also `encode_to_numpy` on
  a thread pool, the call prepare itself uses.
Peak memory is each process's maximum resident set size. Also times training an 8192-id BPE on
tiny-shakespeare + WikiText-2 (valid + test). Writes bench/results/prepare.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("tinyshakespeare.txt", "wikitext2-valid.txt", "wikitext2-test.txt")

BASELINE = r"""
import json, os, resource, sys, time
from concurrent.futures import ThreadPoolExecutor
sys.path.insert(0, sys.argv[3])
from gpt.data.tokenizer import get_tokenizer
enc = get_tokenizer("gpt2", ranks_file=sys.argv[2]).enc
folder = sys.argv[1]
texts = [open(os.path.join(folder, n), encoding="utf-8").read() for n in sorted(os.listdir(folder))]
nbytes = sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder))
threads = len(os.sched_getaffinity(0))
t0 = time.perf_counter()
ids = enc.encode_ordinary_batch(texts, num_threads=threads)
seconds = time.perf_counter() - t0
result = {"seconds": seconds, "tokens": sum(map(len, ids)), "threads": threads}
if sys.argv[4] == "numpy":
    del ids
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        arrays = list(pool.map(lambda t: enc.encode_to_numpy(t, disallowed_special=()), texts))
    result["numpy_seconds"] = time.perf_counter() - t0
result["nbytes"] = nbytes
print(json.dumps(result))
"""


def build_corpus(folder: Path, shared: Path, megabytes: int) -> int:
    folder.mkdir(parents=True)
    total, i = 0, 0
    while total < megabytes * 1e6:
        src = shared / SOURCES[i % len(SOURCES)]
        dst = folder / f"{i:05d}-{src.name}"
        shutil.copyfile(src, dst)
        total += dst.stat().st_size
        i += 1
    return total


def run(cmd: list[str]) -> tuple[str, float, float]:
    """(stdout, wall seconds, peak RSS in MB) of a child process."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    out, err = proc.stdout.read(), proc.stderr.read()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{err}")
    return out, wall, usage.ru_maxrss / 1024  # Linux reports KiB


def bench_size(megabytes: int, shared: Path, ranks: Path, tmp: Path, first: bool) -> dict:
    corpus = tmp / f"corpus-{megabytes}"
    nbytes = build_corpus(corpus, shared, megabytes)
    mb = nbytes / 1e6
    out, wall, rss = run(
        [
            sys.executable,
            str(ROOT / "data" / "prepare.py"),
            str(corpus),
            "--out",
            str(tmp / f"ds-{megabytes}"),
            "--tokenizer",
            "gpt2",
            "--tokenizer-file",
            str(ranks),
            "--quiet",
        ]
    )
    inner = mb / float(re.search(r"\(([\d.,]+) MB/s\)", out).group(1).replace(",", ""))  # prepare's own seconds
    meta = json.loads((tmp / f"ds-{megabytes}" / "meta.json").read_text())
    shutil.rmtree(tmp / f"ds-{megabytes}")
    base_out, _, base_rss = run(
        [sys.executable, "-c", BASELINE, str(corpus), str(ranks), str(ROOT), "numpy" if first else "-"]
    )
    base = json.loads(base_out)
    shutil.rmtree(corpus)
    # ours appends one end-of-text per document: the same ids otherwise
    assert meta["tokens"] == base["tokens"] + meta["documents"], (meta["tokens"], base["tokens"])
    row = {
        "corpus_mb": round(mb, 1),
        "documents": meta["documents"],
        "tokens": meta["tokens"],
        "ours_mb_s": round(mb / inner, 2),
        "ours_wall_mb_s": round(mb / wall, 2),
        "ours_peak_rss_mb": round(rss),
        "tiktoken_batch_mb_s": round(mb / base["seconds"], 2),
        "tiktoken_peak_rss_mb": round(base_rss),
        "ratio": round(base["seconds"] / inner, 3),
        "ratio_wall": round(base["seconds"] / wall, 3),
        "threads": base["threads"],
    }
    if "numpy_seconds" in base:
        row["tiktoken_numpy_pool_mb_s"] = round(mb / base["numpy_seconds"], 2)
    return row


def bench_bpe(shared: Path, vocab_size: int = 8192) -> dict:
    sys.path.insert(0, str(ROOT))
    from gpt.data.bpe import train_bpe

    text = "".join((shared / name).read_text(encoding="utf-8") for name in SOURCES)
    chunks = [text[i : i + (1 << 20)] for i in range(0, len(text), 1 << 20)]
    t0 = time.perf_counter()
    tok = train_bpe(chunks, vocab_size)
    seconds = time.perf_counter() - t0
    return {
        "corpus_mb": round(len(text.encode()) / 1e6, 2),
        "vocab_size": tok.vocab_size,
        "seconds": round(seconds, 2),
        "tokens_per_byte": round(len(tok.encode(text)) / len(text.encode()), 4),
    }


def documents(shared: Path, megabytes: int, size: int = 4096) -> list[str]:
    """The sources, repeated, cut at blank lines into documents of about `size` characters."""
    paragraphs = [p for name in SOURCES for p in (shared / name).read_text(encoding="utf-8").split("\n\n") if p.strip()]
    docs, current, total, i = [], [], 0, 0
    while total < megabytes * 1e6:
        current.append(paragraphs[i % len(paragraphs)])
        i += 1
        if sum(map(len, current)) >= size:
            docs.append("\n\n".join(current))
            total += len(docs[-1].encode())
            current = []
    return docs


def write_formats(docs: list[str], folder: Path) -> dict[str, Path]:
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True)
    paths = {name: folder / f"corpus.{name}" for name in ("txt", "jsonl", "jsonl.gz", "parquet")}
    paths["txt"].write_text("\n\n".join(docs), encoding="utf-8")
    lines = "".join(json.dumps({"text": d}, ensure_ascii=False) + "\n" for d in docs)
    paths["jsonl"].write_text(lines, encoding="utf-8")
    with gzip.open(paths["jsonl.gz"], "wt", encoding="utf-8") as f:
        f.write(lines)
    pq.write_table(pa.table({"text": docs}), paths["parquet"], row_group_size=1000)
    return paths


def _write_corpus(shared: Path, megabytes: int, folder: Path, sizes) -> None:
    docs = documents(shared, megabytes)
    sizes.put(sum(len(d.encode()) for d in docs) / 1e6)
    write_formats(docs, folder)


def bench_formats(megabytes: int, shared: Path, ranks: Path, tmp: Path, repeats: int = 3) -> list[dict]:
    # The corpus is built in a child process: a child inherits its parent's peak RSS (Linux keeps
    # ru_maxrss across fork and exec), so the parent stays small and each prepare's peak is its own.
    import multiprocessing

    folder = tmp / f"formats-{megabytes}"
    sizes = multiprocessing.Queue()
    writer = multiprocessing.Process(target=_write_corpus, args=(shared, megabytes, folder, sizes))
    writer.start()
    text_mb = sizes.get()
    writer.join()
    paths = {name: folder / f"corpus.{name}" for name in ("txt", "jsonl", "jsonl.gz", "parquet")}
    runs = {name: [] for name in paths}
    for _ in range(repeats):  # interleaved, so a slow moment of the machine hits every format alike
        for name, path in paths.items():
            out_dir = tmp / f"ds-{megabytes}-{name}"
            cmd = [sys.executable, str(ROOT / "data" / "prepare.py"), str(path), "--out", str(out_dir)]
            out, wall, rss = run([*cmd, "--tokenizer", "gpt2", "--tokenizer-file", str(ranks), "--quiet"])
            meta = json.loads((out_dir / "meta.json").read_text())
            shutil.rmtree(out_dir)
            runs[name].append((float(re.search(r" in ([\d.]+) s \(", out).group(1)), wall, rss, meta))
    rows = []
    for name, results in runs.items():
        seconds = statistics.median(r[0] for r in results)
        meta = results[0][3]
        rows.append(
            {
                "text_mb": round(text_mb, 1),
                "format": name,
                "file_mb": round(paths[name].stat().st_size / 1e6, 1),
                "documents": meta["documents"],
                "tokens": meta["tokens"],
                "seconds": seconds,
                "all_seconds": [r[0] for r in results],
                "text_mb_s": round(text_mb / seconds, 2),
                "tokens_per_s": round(meta["tokens"] / seconds),
                "wall_s": round(statistics.median(r[1] for r in results), 2),
                "peak_rss_mb": round(max(r[2] for r in results)),
                "vs_txt": round(rows[0]["seconds"] / seconds, 3) if rows else 1.0,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    shutil.rmtree(tmp / f"formats-{megabytes}")
    return rows


def formats_main(args, shared: Path, ranks: Path) -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    import harness

    with tempfile.TemporaryDirectory(prefix="bench-formats-") as tmp:
        rows = [r for size in args.sizes.split(",") for r in bench_formats(int(size), shared, ranks, Path(tmp))]
    result = {"machine": harness.machine(), "formats": rows, "date": time.strftime("%Y-%m-%d")}
    out = Path(args.out if args.out != DEFAULT_OUT else ROOT / "bench" / "results" / "prepare_formats.json")
    out.write_text(json.dumps(result, indent=1) + "\n")
    print("\n| text | format | file | prepare | text MB/s | tokens/s | vs .txt | peak RSS |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['text_mb']} MB | .{r['format']} | {r['file_mb']} MB | {r['seconds']:.1f} s | {r['text_mb_s']} "
            f"| {r['tokens_per_s']:,} | {r['vs_txt']:.0%} | {r['peak_rss_mb']} MB |"
        )
    print(f"results in {out}")


DEFAULT_OUT = str(ROOT / "bench" / "results" / "prepare.json")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="100,200", help="corpus sizes in MB (default: %(default)s)")
    p.add_argument("--shared", default=str(ROOT.parent / "shared" / "data"), help="folder with the source corpora")
    p.add_argument("--out", default=DEFAULT_OUT)
    p.add_argument("--formats", action="store_true", help="the same text from .txt, .jsonl, .jsonl.gz and .parquet")
    args = p.parse_args()
    shared = Path(args.shared)
    ranks = shared / "gpt2.tiktoken"
    if args.formats:
        return formats_main(args, shared, ranks)
    load_before = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-prepare-") as tmp:
        for i, size in enumerate(int(s) for s in args.sizes.split(",")):
            rows.append(bench_size(size, shared, ranks, Path(tmp), first=i == 0))
            print(json.dumps(rows[-1]), flush=True)
    bpe = bench_bpe(shared)
    print(json.dumps({"bpe": bpe}), flush=True)
    result = {
        "machine": {
            "cpus": os.cpu_count(),
            "affinity": len(os.sched_getaffinity(0)),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in os.getloadavg()],
        },
        "prepare_gpt2": rows,
        "bpe_training": bpe,
        "date": time.strftime("%Y-%m-%d"),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print("\n| corpus | ours (prepare) | ours (process) | tiktoken batch | ratio | ours peak RSS | tiktoken peak RSS |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['corpus_mb']} MB | {r['ours_mb_s']} MB/s | {r['ours_wall_mb_s']} MB/s | {r['tiktoken_batch_mb_s']} MB/s "
            f"| {r['ratio']:.0%} | {r['ours_peak_rss_mb']} MB | {r['tiktoken_peak_rss_mb']} MB |"
        )
    print(f"\nBPE {bpe['vocab_size']} ids on {bpe['corpus_mb']} MB: {bpe['seconds']} s; results in {args.out}")


if __name__ == "__main__":
    main()
