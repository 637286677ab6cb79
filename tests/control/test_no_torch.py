"""The controller runs in the simulator's process too: importing it must not pull torch."""
import subprocess
import sys


def test_control_imports_no_torch():
    code = "import sys; import conveyor.control; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
