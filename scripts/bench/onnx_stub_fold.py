"""What torch.onnx does with a weight-free stub of one 16384 x 16384 linear (1 GiB in fp32), each way
the stub can be written: the process's peak RSS after the export and the proto's size.

    .venv/bin/python scripts/bench/onnx_stub_fold.py            # every variant, each in its own process

- constantofshape: MatMul(x, ConstantOfShape([in, out])) (slmedge's stubs before 3ba84af)
- expand:          MatMul(x, Expand(zeros(1, 1), [in, out])) (slmedge.export.onnx_stub now)
- tile:            MatMul(x, Tile(zeros(1, 1), [in, out]))
"""
import io
import json
import resource
import subprocess
import sys

IN = OUT = 16384


def run(variant: str) -> dict:
    import torch

    class Stub(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.new_zeros(*x.shape[:-1], OUT)

        @staticmethod
        def symbolic(g, x):
            shape = g.op("Constant", value_t=torch.tensor([IN, OUT], dtype=torch.int64))
            if variant == "constantofshape":
                w = g.op("ConstantOfShape", shape, value_t=torch.zeros(1))
            else:
                w = g.op(variant.capitalize(), g.op("Constant", value_t=torch.zeros(1, 1)), shape)
            return g.op("MatMul", x, w)

    class M(torch.nn.Module):
        def forward(self, x):
            return Stub.apply(x) + 1

    f = io.BytesIO()
    try:
        torch.onnx.export(M(), (torch.randn(2, 3, IN),), f, input_names=["x"],
                          dynamic_axes={"x": {0: "b", 1: "s"}}, dynamo=False, opset_version=14)
        proto = f"{len(f.getvalue())} bytes"
    except RuntimeError as exc:  # protobuf's 2 GiB limit: the stub became a 1 GiB constant
        proto = str(exc).split(".")[0]
    return {"variant": variant, "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, "proto": proto}


if __name__ == "__main__":
    if len(sys.argv) > 1:
        print(json.dumps(run(sys.argv[1])))
    else:
        for v in ("constantofshape", "expand", "tile"):
            out = subprocess.run([sys.executable, __file__, v], capture_output=True, text=True)
            print(out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr[-500:])
