"""Sampling and grammar masks work on numpy arrays: importing them must not pull torch (the serving
process is to import none: docs/PERF.md, "Memory")."""
import subprocess
import sys


def test_sampling_and_structured_outputs_import_no_torch():
    code = ("import sys; import conveyor.sampling.sampler, conveyor.structured.masking, conveyor.structured.matchers; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
