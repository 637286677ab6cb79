"""The serving process imports no torch: numpy and the C++ kernels run the model, so a server holds
none of torch's ~190 MiB (docs/PERF.md, "Memory"). Checked on the real default model, through the
server's modules, a load, a greedy and a sampled request."""
import subprocess
import sys

CODE = """
import sys
import conveyor.api.server
from conveyor import LLM, SamplingParams
llm = LLM("smollm2-135m", num_kv_blocks=64, max_num_seqs=2)
outs = llm.generate(["The capital of France is", "def add(a, b):"],
                    [SamplingParams(max_tokens=8, temperature=0), SamplingParams(max_tokens=8, temperature=0.8, seed=1)])
assert all(len(o.outputs[0].token_ids) == 8 for o in outs), outs
print('torch' in sys.modules)
"""


def test_a_served_model_imports_no_torch():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"
