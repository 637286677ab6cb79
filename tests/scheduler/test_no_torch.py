"""The scheduler and KV manager speak token counts and block ids: importing them must not pull torch
(that is what lets the simulator reuse them unchanged)."""
import subprocess
import sys


def test_scheduler_and_kv_import_no_torch():
    code = (
        "import sys; import conveyor.scheduler, conveyor.kv, conveyor.engine.llm_engine; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
