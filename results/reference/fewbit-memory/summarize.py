"""The memory table of this folder's README from its JSON files (python summarize.py)."""
import json
from pathlib import Path

HERE = Path(__file__).parent
METHODS = ["adamw", "fewbit", "approx_bp@norms=false", "approx_bp"]
CATS = ["param", "grad", "optimizer", "activation", "other"]


def row(path):
    r = json.loads(path.read_text())
    if r["status"] != "ok":
        return None, r
    return r["memory"], r


def table(prefix, models, unit, scale):
    lines = [f"| model | method | tier | " + " | ".join(CATS) + f" | peak ({unit}) | peak vs adamw |",
             "|---|---|---|" + "---|" * (len(CATS) + 2)]
    for model in models:
        base = None
        for m in METHODS:
            p = HERE / f"{prefix}_{model}_{m}.json"
            if not p.exists():
                continue
            mem, r = row(p)
            if mem is None:
                lines.append(f"| {model} | {m} | - | {r['status']}: {r.get('message', '')} |")
                continue
            if m == "adamw":
                base = mem["peak_bytes"]
            change = "" if base is None or m == "adamw" else f"{100 * (mem['peak_bytes'] / base - 1):+.1f}%"
            cells = " | ".join(f"{mem[c + '_bytes'] / scale:.2f}" for c in CATS)
            lines.append(f"| {model} | {m} | {mem['tier']} | {cells} | {mem['peak_bytes'] / scale:.2f} | {change} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print("Tiny models, float32, batch 16, sequence 128, tracked (MB = 1e6 bytes):\n")
    print(table("tracked", ["gpt2-tiny", "bert-tiny", "llama-tiny"], "MB", 1e6))
    print("\nPaper sizes, bfloat16, batch 8, sequence 512, simulated (GiB = 2^30 bytes):\n")
    print(table("sim", ["gpt2-xl", "bert-large", "llama-7b"], "GiB", 2 ** 30))
