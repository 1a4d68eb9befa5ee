"""The test files that run on the device under test, each in its own pytest process with a deadline."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from typing import Any

from zero_bench.gpu.report import Report, table

# The suites that put their inputs on the device under test (see [Note: the device under test] in
# zero_core.testing.distributed): the harness, the comm backend, parity, counting, checkpoints,
# offload, idioms and robustness. The dry run checks the machinery with the harness's own tests.
FILES = ("packages/core/tests/test_core_harness.py", "packages/comm/tests/test_comm_torch_backend.py",
         "packages/offload/tests/test_offload_units.py", "tests/test_checkpoint.py", "tests/test_parity.py",
         "tests/test_counting.py", "tests/test_offload.py", "tests/test_idioms.py", "tests/test_robust.py")
DRY_RUN_FILES = ("packages/core/tests/test_core_harness.py",)


def _counts(junit: str) -> dict[str, Any]:
    root = ET.parse(junit).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    out = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    out["failed"] = [f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}: "
                     + (case.find("failure") if case.find("failure") is not None else case.find("error")).get("message", "")[:200]
                     for s in suites for case in s.iter("testcase")
                     if case.find("failure") is not None or case.find("error") is not None]
    return out


def run_cuda_tests(report: Report, root: str, device: str, dry_run: bool, deadline_s: float, workers: int) -> None:
    env = dict(os.environ, ZERO_TEST_DEVICE=device, PYTHONUNBUFFERED="1")
    rows, results = [], {}
    if os.path.exists(os.path.join(report.out, "pytest.txt")):
        os.remove(os.path.join(report.out, "pytest.txt"))
    for path in DRY_RUN_FILES if dry_run else FILES:
        left = deadline_s - report.elapsed()
        if left < 20:
            results[path] = {"skipped": "time budget"}
            rows.append([path, "", "", "", "", "skipped: time budget"])
            continue
        junit = os.path.join(report.out, "junit.xml")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--junitxml", junit, "-o", "timeout=300", path]
        if workers > 1:
            cmd += ["-n", str(workers)]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=left)
            with open(os.path.join(report.out, "pytest.txt"), "a") as log:  # the failures' whole tracebacks
                log.write(f"===== {' '.join(cmd[1:])}\n{proc.stdout}{proc.stderr}\n")
            result = _counts(junit) if os.path.exists(junit) else {"error": proc.stdout[-2000:] + proc.stderr[-2000:]}
            result["rc"] = proc.returncode
        except subprocess.TimeoutExpired:
            result = {"error": f"killed after {left:.0f} s (the section's deadline)"}
        finally:
            if os.path.exists(junit):
                os.remove(junit)
        result["seconds"] = round(time.perf_counter() - t0, 1)
        results[path] = result
        if "tests" in result:
            passed = result["tests"] - result["failures"] - result["errors"] - result["skipped"]
            rows.append([path, passed, result["failures"] + result["errors"], result["skipped"], result["seconds"],
                         "<br>".join(result["failed"][:8])])
        else:
            rows.append([path, "", "", "", result["seconds"], f"ERROR: {result['error'][-300:]}"])
        report.log(f"   {path}: {rows[-1][1:5]}")
        report.results["sections"]["cuda tests"] = {"device": device, "files": results}
        report.block("cuda tests", [
            "\n## The test suite on the device under test\n",
            f"`ZERO_TEST_DEVICE={device} python -m pytest FILE`" + (f" with `-n {workers}`" if workers > 1 else "")
            + ": world size 1 uses NCCL on the GPU; 2 and 4 ranks share it over gloo with CUDA tensors (see the gloo "
            "section for the collectives gloo takes on CUDA tensors).\n",
            *table(["file", "passed", "failed", "skipped", "seconds", "failures (first 8)"], rows)])
