#!/usr/bin/env python3
"""The GPU check's report: burn-amp's results beside PyTorch's, as one markdown table.

    python3 scripts/gpu_table.py OUT_DIR     # reads gpu_check.jsonl (+ numerics.jsonl, torch.jsonl if there)
    python3 scripts/gpu_table.py --selftest  # canned input in scripts/testdata/gpu-check/

Writes OUT_DIR/table.md, prints it, and prints one {"kind":"summary",...} JSON line last.
Exits 1 when a correctness case failed or gpu_check.jsonl is missing or empty, else 0.
Lines that are not JSON objects (log text) are ignored. Standard library only: the GPU
machine has no network.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile

BURN_FILE, TORCH_FILE, TABLE_FILE = "gpu_check.jsonl", "torch.jsonl", "table.md"
# gpu_check's numerics part, run last in the time left (`--only numerics`).
NUMERICS_FILE = "numerics.jsonl"
PRECISIONS = ["f32", "bf16", "f16"]
MODELS = ["transformer", "mlp"]
SUITES = ["policy", "kernels", "scaled_step", "accumulation", "numerics", "workarounds",
          "random graphs"]
DASH = "—"
MIB = 1024 * 1024
TESTDATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "testdata", "gpu-check")


def load(path):
    """The JSON objects of a JSON-lines file, or None when the file is missing."""
    if not os.path.exists(path):
        return None
    records = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                records.append(record)
    return records


def num(value):
    """A finite number, or None (null, text, NaN, a bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value if value == value and abs(value) != float("inf") else None


def ratio(a, b):
    a, b = num(a), num(b)
    return a / b if a is not None and b else None


def rounded(value, digits=4):
    return None if value is None else round(value, digits)


def fmt(value, spec):
    value = num(value)
    return DASH if value is None else format(value, spec)


def mib(value):
    value = num(value)
    return DASH if value is None else f"{value / MIB:,.0f}"


def short(text, limit=300):
    text = " ".join(str(text).split())  # one line, whatever the message held
    return text if len(text) <= limit else text[: limit - 1] + "…"


def sum_random_graphs(records):
    """The random graphs' lines, one per seed and comparison, summed into one per comparison
    (where the first of them stood); other records as they are."""
    out, sums = [], {}
    for r in records:
        if r.get("kind") != "correctness" or r.get("suite") != "random graphs" or "seed" not in r:
            out.append(r)
            continue
        s = sums.get(r.get("case"))
        if s is None:
            s = sums[r.get("case")] = {**r, "seeds": 0, "ran": 0, "left_out": 0, "failures": [], "ms": 0.0}
            out.append(s)
        s["seeds"] = max(s["seeds"], (num(r.get("seed")) or 0) + 1)
        s["ms"] += num(r.get("ms")) or 0.0
        if r.get("left_out"):
            s["left_out"] += 1
        else:
            s["ran"] += 1
        if r.get("ok") is not True:
            s["failures"].append(r.get("error") or "(no message)")
    for s in sums.values():
        text = (f"seeds 0..{s['seeds']}: {s['ran']} graphs compared, {s['left_out']} left out "
                f"(ops this comparison cannot hold), {len(s['failures'])} failed")
        s["ok"] = not s["failures"]
        s["detail"] = text if s["ok"] else None
        s["error"] = None if s["ok"] else f"{text}; the first: {s['failures'][:3]}"
        for key in ("seed", "failures", "seeds", "ran"):
            del s[key]
    return out


def ordered(present, known):
    """The known names first, in their order, then the others as they came."""
    return [k for k in known if k in present] + [k for k in present if k not in known]


def row(cells):
    return "| " + " | ".join(str(c) for c in cells) + " |"


def table(header, rows):
    return [row(header), row(["---"] * len(header))] + [row(r) for r in rows]


def speeds(records):
    """{model: {precision: record}}; a later line for the same pair wins."""
    out = {}
    for r in records:
        if r.get("kind") == "speed":
            out.setdefault(str(r.get("model")), {})[str(r.get("precision"))] = r
    return out


def peak_kind(by_precision):
    return next((r["peak_kind"] for r in by_precision.values() if r.get("peak_kind")), None)


def report(burn, torch):
    """(markdown, summary, exit code) for the records of both files (torch None: no file)."""
    burn_ok = bool(burn)
    burn, torch_found, torch = burn or [], torch is not None, torch or []
    env = next((r for r in burn if r.get("kind") == "env"), {})
    warmup = sum(num(r.get("seconds")) or 0.0 for r in burn if r.get("kind") == "warmup")
    torch_version = next((r["torch"] for r in torch if r.get("kind") == "speed" and r.get("torch")), None)

    lines = ["# burn-amp GPU check", ""]
    lines.append(f"Device: **{env.get('device') or DASH}** ({env.get('backend') or DASH})"
                 f" · burn {env.get('burn') or DASH} · PyTorch {torch_version or DASH}"
                 f" · started {env.get('started') or DASH}")
    if env.get("kernel_cache"):
        lines += ["", f"warm-up (autotune, and JIT of what the kernel cache lacked): {warmup:.1f} s"
                      " · kernels compiled ahead without a GPU (scripts/cuda-compile-check.sh)"]
    else:
        lines += ["", f"warm-up (JIT + autotune): {warmup:.1f} s"]
    if not burn_ok:
        lines += ["", f"**{BURN_FILE} is missing or has no JSON lines: the burn-amp run did not report.**"]
    if not torch_found:
        lines += ["", f"({TORCH_FILE} not found: no PyTorch columns.)"]

    # Correctness
    cases = [r for r in burn if r.get("kind") == "correctness"]
    failed = [r for r in cases if r.get("ok") is not True]
    lines += ["", "## Correctness", ""]
    if cases:
        counts = {}
        for r in cases:
            c = counts.setdefault(str(r.get("suite")), [0, 0])
            c[r.get("ok") is not True] += 1
        lines += table(["suite", "passed", "failed"],
                       [[s, counts[s][0], counts[s][1]] for s in ordered(list(counts), SUITES)])
        lines += ["", f"**{len(cases) - len(failed)} passed, {len(failed)} failed.**"]
        if failed:
            lines += ["", "Failed:", ""]
            for r in failed:
                tags = ", ".join(t for t in (r.get("variant"), r.get("dtype")) if t)
                where = f"{r.get('suite')} / {r.get('case')}" + (f" ({tags})" if tags else "")
                lines.append(f"- {where}: {short(r.get('error') or '(no message)')}")
        graphs = [r for r in cases if r.get("suite") == "random graphs" and r.get("ok") is True]
        if graphs:
            lines += ["", "Random graphs (how many the numerics part's time allowed):", ""]
            lines += [f"- {r.get('case')}: {short(r.get('detail') or DASH)}" for r in graphs]
    else:
        lines.append("No correctness records.")

    # Speed, one section per model
    b_speed, t_speed = speeds(burn), speeds(torch)
    summary_speed = {}
    for model in ordered(list(b_speed) + [m for m in t_speed if m not in b_speed], MODELS):
        b, t = b_speed.get(model, {}), t_speed.get(model, {})
        both = [*b.values(), *t.values()]
        sizes = next((r["sizes"] for r in both if isinstance(r.get("sizes"), dict)), {})
        steps = next((r["steps"] for r in both if r.get("steps") is not None), DASH)
        per_step = next((r["tokens_per_step"] for r in both if r.get("tokens_per_step") is not None), DASH)
        lines += ["", f"## Speed: {model}", ""]
        about = ", ".join(f"{k} {v}" for k, v in sizes.items())
        lines += [(about + "; " if about else "") + f"{per_step} tokens/step; median of {steps} timed steps"]
        # burn-amp's peak is sampled (a lower bound), PyTorch's exact: the line says so.
        kinds = [f"{who}: {kind}" for who, kind in (("burn-amp", peak_kind(b)), ("PyTorch", peak_kind(t)))
                 if kind]
        lines += ["", "Peak memory: " + "; ".join(kinds) + "."] if kinds else []
        # f32 is f32 storage with TF32 matmuls on both sides (like for like); say what PyTorch
        # ran with, per row, as its lines report it.
        tf32 = [f"{p} {'on' if r.get('tf32') else 'off' if r.get('tf32') is False else 'unknown'}"
                for p, r in t.items() if p.startswith("f32")]
        probe = next((r for r in burn if r.get("kind") == "probe" and r.get("what") == "f32 matmul"), None)
        if probe and num(probe.get("rel_l2")) is not None:
            ours = (f"burn-amp's {'TF32' if probe.get('tf32') else 'f32'} (measured: relative error "
                    f"{num(probe['rel_l2']):.1e} against f64 at {probe.get('shape')}, after autotune)")
        else:
            ours = "burn-amp's in TF32 where autotune picks a tensor-core kernel (cubek-matmul on CUDA; not measured)"
        if tf32 or probe:
            lines += ["", f"f32 matmuls: {ours}; PyTorch's TF32: " + (", ".join(tf32) or DASH) + "."]
        lines.append("")
        # Always the three rows, so a missing run shows as dashes; any other precision after.
        precisions = list(dict.fromkeys(PRECISIONS + list(b) + list(t)))
        main_rows, vs_rows, train_rows = [], [], []
        b32, t32 = b.get("f32", {}), t.get("f32", {})
        summary_speed[model] = {}
        for p in precisions:
            br, tr = b.get(p, {}), t.get(p, {})
            bms, tms = br.get("ms_per_step"), tr.get("ms_per_step")
            main_rows.append([
                p, fmt(bms, ".2f"), fmt(tms, ".2f"), fmt(ratio(bms, tms), ".2f"),
                fmt(br.get("tokens_per_s"), ",.0f"), fmt(tr.get("tokens_per_s"), ",.0f"),
                mib(br.get("peak_bytes")), mib(tr.get("peak_bytes")),
                fmt(ratio(br.get("peak_bytes"), tr.get("peak_bytes")), ".2f"),
            ])
            vs_rows.append([
                p, fmt(ratio(bms, b32.get("ms_per_step")), ".2f"),
                fmt(ratio(tms, t32.get("ms_per_step")), ".2f"),
                fmt(ratio(br.get("peak_bytes"), b32.get("peak_bytes")), ".2f"),
                fmt(ratio(tr.get("peak_bytes"), t32.get("peak_bytes")), ".2f"),
            ])
            # A fast run that does not train would look good above: the loss says if it does.
            train_rows.append([
                p, fmt(br.get("final_loss"), ".5g"), fmt(tr.get("final_loss"), ".5g"),
                fmt(br.get("skipped_steps"), ".0f"), fmt(tr.get("skipped_steps"), ".0f"),
                fmt(br.get("host_reads_per_step"), "g"),
            ])
            summary_speed[model][p] = {
                "burn_ms": num(bms), "torch_ms": num(tms),
                "burn_over_torch": rounded(ratio(bms, tms)),
                "burn_vs_f32": rounded(ratio(bms, b32.get("ms_per_step"))),
                "torch_vs_f32": rounded(ratio(tms, t32.get("ms_per_step"))),
                "burn_peak_over_torch": rounded(ratio(br.get("peak_bytes"), tr.get("peak_bytes"))),
            }
        lines += table(["precision", "burn-amp ms/step", "PyTorch ms/step", "burn-amp/PyTorch time",
                        "burn-amp tokens/s", "PyTorch tokens/s", "burn-amp peak MiB",
                        "PyTorch peak MiB", "burn-amp peak / PyTorch peak"], main_rows)
        lines += ["", "Against f32 of the same implementation (below 1: faster or smaller):", ""]
        lines += table(["precision", "burn-amp time vs f32", "PyTorch time vs f32",
                        "burn-amp peak vs f32", "PyTorch peak vs f32"], vs_rows)
        lines += ["", "Training (the last step's loss; steps skipped for inf/NaN gradients):", ""]
        lines += table(["precision", "burn-amp final loss", "PyTorch final loss", "burn-amp skipped",
                        "PyTorch skipped", "burn-amp host reads/step"], train_rows)

    # Bandwidth
    bands = [r for r in burn if r.get("kind") == "bandwidth"]
    if bands:
        lines += ["", "## Bandwidth", ""]
        rows = []
        for r in bands:
            share = ratio(r.get("gb_per_s"), r.get("reference_gb_per_s"))
            rows.append([r.get("kernel") or DASH, r.get("dtype") or DASH, fmt(r.get("elements"), ",.0f"),
                         fmt(r.get("gb_per_s"), ",.1f"), fmt(r.get("reference_gb_per_s"), ",.0f"),
                         DASH if share is None else f"{100 * share:.1f} %"])
        lines += table(["kernel", "dtype", "elements", "GB/s", "reference GB/s", "of reference"], rows)

    # A weight average on the device and in host memory: the device bytes it keeps against
    # its time per optimizer step (the first row, on the device, is the base).
    emas = [r for r in burn if r.get("kind") == "ema"]
    if emas:
        lines += ["", "## Weight average (EMA): on the device or in host memory", ""]
        base = num(emas[0].get("ms_per_step"))
        lines.append(f"An f32 average of an f16 model ({emas[0].get('model') or DASH}, "
                     f"{mib(emas[0].get('weight_bytes'))} MiB of weights), per optimizer step, median.")
        lines.append("")
        rows = []
        for r in emas:
            kept = ratio(r.get("device_bytes"), r.get("weight_bytes"))
            rows.append([r.get("average") or DASH, fmt(r.get("device_bytes"), ",.0f"),
                         DASH if kept is None else f"{kept:.3f}", fmt(r.get("ms_per_step"), ".3f"),
                         fmt(ratio(r.get("ms_per_step"), base), ".2f")])
        lines += table(["average", "device bytes kept", "/ weight bytes", "ms per step", "/ on the device"],
                       rows)

    # What plain Burn does on this device where burn-amp works around a defect (canaries)
    infos = [r for r in burn if r.get("kind") == "info"]
    if infos:
        lines += ["", "## Plain Burn on this device (where burn-amp works around a defect)", ""]
        for r in infos:
            lines.append(f"- {r.get('case') or DASH}: {short(r.get('detail') or r.get('error') or DASH)}")

    # A lost device: a case ended the device's stream (a kernel that failed to compile or
    # launch), gpu_check stopped, and gpu-check.sh started a new process where it left off (an
    # env line with that `resume`). One that was not resumed left the rest of its part unrun.
    lost = []
    for i, r in enumerate(burn):
        if r.get("kind") == "device_lost":
            resumed = any(e.get("kind") == "env" and e.get("resume") == r.get("resume")
                          for e in burn[i + 1:])
            lost.append((r, resumed))
    if lost:
        lines += ["", "## Device lost (a case ended the device's stream)", ""]
        for r, resumed in lost:
            what = f"a new process went on at {r.get('resume')}" if resumed else \
                f"**not resumed** (no time left?): what comes after {r.get('resume')} did not run"
            simulated = " (simulated: --simulate-device-lost-at)" if r.get("simulated") else ""
            lines.append(f"- after {r.get('after') or DASH}{simulated}: {what}")
    not_resumed = sum(not resumed for _, resumed in lost)

    # Errors / skipped, from both files
    problems = [("burn-amp", r) for r in burn if r.get("kind") in ("error", "skipped")]
    problems += [("PyTorch", r) for r in torch if r.get("kind") in ("error", "skipped")]
    if problems:
        lines += ["", "## Errors / skipped", ""]
        for who, r in problems:
            where = " / ".join(str(r[k]) for k in ("suite", "case", "dtype", "model", "precision", "what") if r.get(k))
            text = r.get("error") if r.get("kind") == "error" else r.get("why")
            where = f": {where}" if where else ""
            lines.append(f"- {who} {r['kind']}{where}: {short(text or '(no message)')}")

    code = 1 if failed or not burn_ok or not_resumed else 0
    summary = {
        "kind": "summary", "device": env.get("device"), "burn_reported": burn_ok,
        "torch_found": torch_found, "correctness_passed": len(cases) - len(failed),
        "correctness_failed": len(failed), "warmup_s": round(warmup, 3),
        "speed": summary_speed,
        "bandwidth": [{"kernel": r.get("kernel"), "dtype": r.get("dtype"), "gb_per_s": num(r.get("gb_per_s")),
                       "of_reference": rounded(ratio(r.get("gb_per_s"), r.get("reference_gb_per_s")))}
                      for r in bands],
        "ema": [{"average": r.get("average"), "ms_per_step": num(r.get("ms_per_step")),
                 "device_bytes": num(r.get("device_bytes"))} for r in emas],
        "errors": sum(r.get("kind") == "error" for _, r in problems),
        "skipped": sum(r.get("kind") == "skipped" for _, r in problems),
        "device_lost": len(lost), "device_lost_not_resumed": not_resumed, "exit_code": code,
    }
    return "\n".join(lines) + "\n", summary, code


def run(out_dir):
    burn = load(os.path.join(out_dir, BURN_FILE))
    numerics = load(os.path.join(out_dir, NUMERICS_FILE))
    if burn is not None:
        burn = sum_random_graphs(burn + (numerics or []))
    markdown, summary, code = report(burn, load(os.path.join(out_dir, TORCH_FILE)))
    with open(os.path.join(out_dir, TABLE_FILE), "w", encoding="utf-8") as f:
        f.write(markdown)
    sys.stdout.write(markdown)
    print(json.dumps(summary), flush=True)
    return code


def selftest(bless=False):
    """Runs this script as a program on the canned input, twice: as given, and without its failed case."""
    expected_path = os.path.join(TESTDATA, TABLE_FILE)
    problems = []

    def case(burn_lines, want_code, want_table):
        with tempfile.TemporaryDirectory() as tmp:
            with open(os.path.join(tmp, BURN_FILE), "w", encoding="utf-8") as f:
                f.writelines(burn_lines)
            shutil.copy(os.path.join(TESTDATA, TORCH_FILE), tmp)
            shutil.copy(os.path.join(TESTDATA, NUMERICS_FILE), tmp)
            done = subprocess.run([sys.executable, os.path.abspath(__file__), tmp],
                                  capture_output=True, text=True, encoding="utf-8")
            if done.returncode != want_code:
                problems.append(f"exit code {done.returncode}, wanted {want_code}\n{done.stderr}")
            try:
                summary = json.loads(done.stdout.strip().splitlines()[-1])
                assert summary["kind"] == "summary" and summary["exit_code"] == want_code
            except (IndexError, ValueError, KeyError, AssertionError) as e:
                problems.append(f"last stdout line is not the summary ({e!r})")
            with open(os.path.join(tmp, TABLE_FILE), "rb") as f:
                produced = f.read()
        if want_table is None:
            return
        if bless:
            with open(expected_path, "wb") as f:
                f.write(produced)
        elif produced != want_table:
            import difflib
            diff = difflib.unified_diff(want_table.decode("utf-8").splitlines(True),
                                        produced.decode("utf-8").splitlines(True),
                                        "expected/" + TABLE_FILE, "produced/" + TABLE_FILE)
            problems.append("table.md differs:\n" + "".join(diff))

    with open(os.path.join(TESTDATA, BURN_FILE), encoding="utf-8") as f:
        burn_lines = f.readlines()
    want = b""
    if os.path.exists(expected_path) and not bless:
        with open(expected_path, "rb") as f:
            want = f.read()
    case(burn_lines, 1, want)

    def is_failed_case(line):
        try:
            r = json.loads(line)
        except ValueError:
            return False
        return isinstance(r, dict) and r.get("kind") == "correctness" and r.get("ok") is not True

    passing = [line for line in burn_lines if not is_failed_case(line)]
    if len(passing) == len(burn_lines):
        problems.append("the canned input has no failed correctness case")
    case(passing, 0, None)

    # A lost device that no process resumed fails the check, even with every case passing.
    def is_resumption(line):
        try:
            r = json.loads(line)
        except ValueError:
            return False
        return isinstance(r, dict) and r.get("kind") == "env" and r.get("resume")

    unresumed = [line for line in passing if not is_resumption(line)]
    if len(unresumed) == len(passing):
        problems.append("the canned input has no resumed process")
    case(unresumed, 1, None)

    if problems:
        print("\n".join(problems))
        print("gpu_table selftest: FAILED")
        return 1
    print("gpu_table selftest: ok" + (" (expected table.md written)" if bless else ""))
    return 0


def main(argv):
    # The table has "—" and "·": never die on a terminal that cannot show them.
    sys.stdout.reconfigure(errors="replace")
    if argv[1:2] == ["--selftest"]:
        # --bless rewrites the expected table from the canned input: inspect it before committing.
        return selftest(bless=argv[2:] == ["--bless"])
    if len(argv) != 2 or argv[1].startswith("-"):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    return run(argv[1])


if __name__ == "__main__":
    sys.exit(main(sys.argv))
