"""The ONNX graph without the model's linear weights, and the weights placed into it one at a time.

optimum's exporter traces a torch model: with the model whole, a 3.8B decoder costs its fp32
copy (15 GB), torch.onnx's constant-folded transposes of every weight and the serialized proto
(as much again), optimum's reload of the file, the tied-weight pass's second reload... about five
times the fp32 model (measured: 10.3 GB peak for Qwen2.5-0.5B's 494 M parameters). None of that
is needed to get the graph: the trace only needs the shapes. So the model optimum traces here
has every ``nn.Linear`` replaced by a :class:`StubLinear`, which holds no weight (its bias, if
any, stays a real parameter): in the trace it returns zeros of the output's shape, and in the
ONNX graph it is ``MatMul(x, Expand(0, [in, out]))``, a valid graph (optimum's own
session on the file loads it) that holds no weight bytes. Everything else (embeddings, norms,
biases, rotary buffers) is read from the source as the full model would have it; the rest of
the graph (node names included: ``/model/layers.0/self_attn/q_proj/MatMul``) is what the full
model's trace gives.

Then each stub becomes, in place, either ``MatMulNBits`` built from the artifact's codes (read
one linear at a time from ``quantization.safetensors``), or a ``MatMul`` with the linear's
transposed weight read from the source (fp32, or fp16 for an fp16 export) as an initializer,
exactly the constant torch.onnx folds from the whole model; a tied head reads the embedding
through a ``Transpose`` as optimum's tied-weight pass writes it. Peak memory is the interpreter,
the small tensors, the largest single linear and what the file itself holds.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


class _StubMatMul:
    """Built lazily (torch is imported only when an export runs)."""

    fn = None

    @classmethod
    def get(cls):
        if cls.fn is None:
            import torch

            class StubMatMul(torch.autograd.Function):
                @staticmethod
                def forward(ctx, x, in_features: int, out_features: int, half: int):  # noqa: ARG004 - torch's
                    return x.new_zeros(*x.shape[:-1], out_features)

                @staticmethod
                def symbolic(g, x, in_features: int, out_features: int, half: int):
                    # Expand of a 1x1 zero, not ConstantOfShape: torch.onnx's shape inference computes
                    # a ConstantOfShape of constant shape in full and keeps the value until the export
                    # ends (every linear's fp32 weight at once: 15 GB for a 3.8B model); an Expand it
                    # leaves alone (scripts/bench/onnx_stub_fold.py, scripts/bench_onnx_memory.py).
                    zero = g.op("Constant", value_t=torch.zeros(1, 1, dtype=torch.float16 if half else torch.float32))
                    shape = g.op("Constant", value_t=torch.tensor([in_features, out_features], dtype=torch.int64))
                    return g.op("MatMul", x, g.op("Expand", zero, shape))

            cls.fn = StubMatMul
        return cls.fn


def _stub_linear_class():
    import torch

    class StubLinear(torch.nn.Module):
        """An ``nn.Linear`` without its weight: zeros in the trace, ``MatMul(x, Expand(0, [in, out]))`` in ONNX."""

        def __init__(self, linear):
            super().__init__()
            self.in_features, self.out_features = linear.in_features, linear.out_features
            self.half = int(linear.weight.dtype == torch.float16)  # the weight's type in the graph
            self.bias = linear.bias  # still on the meta device: loaded with the other small tensors

        def forward(self, x):
            y = _StubMatMul.get().apply(x, self.in_features, self.out_features, self.half)
            return y if self.bias is None else y + self.bias

    return StubLinear


def build_stub_model(path: Path, config, dtype, read_tensors):
    """The model of ``config`` with every linear a :class:`StubLinear`, its other tensors from
    ``read_tensors(names)`` (fp32 numpy arrays, cast here to what the model holds).

    Returns (model, {linear module name: (in, out)}, {tied linear name: embedding tensor name}).
    """
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM, GenerationConfig

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, torch_dtype=dtype)
    tied = {}
    if getattr(config, "tie_word_embeddings", False):
        out_emb, in_emb = model.get_output_embeddings(), model.get_input_embeddings()
        names = {id(m): n for n, m in model.named_modules()}
        if out_emb is not None and in_emb is not None and id(out_emb) in names:
            tied[names[id(out_emb)]] = names[id(in_emb)] + ".weight"
    stub_cls = _stub_linear_class()
    linears = {}
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, torch.nn.Linear):
                full = f"{name}.{child_name}" if name else child_name
                linears[full] = (child.in_features, child.out_features)
                setattr(module, child_name, stub_cls(child))
    tied = {k: v for k, v in tied.items() if k in linears}
    wanted = {n: t for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta}
    loaded = {}
    for name, array in read_tensors(set(wanted)):
        loaded[name] = torch.from_numpy(np.ascontiguousarray(array)).to(wanted[name].dtype)
    missing = sorted(set(wanted) - set(loaded))
    if missing:
        from .errors import ONNXExportError

        raise ONNXExportError(f"{path} has no tensor {missing[0]} (the model's {len(missing)} missing)")
    model.load_state_dict(loaded, strict=False, assign=True)
    still = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if still:
        from .errors import ONNXExportError

        raise ONNXExportError(f"{still[0]} of {path} was not loaded")
    if (path / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(str(path))
    model.config._name_or_path = str(path)  # optimum copies the tokenizer from there
    model.eval()
    return model, linears, tied


def module_of(node) -> str | None:
    """'/model/layers.0/self_attn/q_proj/MatMul' -> 'model.layers.0.self_attn.q_proj'."""
    name = node.name.strip("/")
    if not name.endswith("/MatMul") or name.count("/") < 1:
        return None
    return name[: -len("/MatMul")].replace("/", ".")


def find_stubs(model, linears: dict) -> dict:
    """linear name -> :class:`Stub` (its MatMul, the Expand with its zero and shape Constants, and the
    Cast that torch.onnx may put between them: an fp16 weight the graph multiplies in fp32) of each linear."""
    from onnx import TensorProto, helper

    producers = {o: n for n in model.graph.node for o in n.output}
    out = {}
    for node in model.graph.node:
        if node.op_type != "MatMul":
            continue
        layer = module_of(node)
        if layer not in linears:
            continue
        cast = producers.get(node.input[1])
        expand = cast
        if cast is not None and cast.op_type == "Cast":
            expand = producers.get(cast.input[0])
        else:
            cast = None
        if expand is None or expand.op_type != "Expand":
            continue
        zero, shape = (producers.get(i) for i in expand.input)
        if zero is None or shape is None or zero.op_type != "Constant" or shape.op_type != "Constant":
            continue
        value = next((a.t for a in zero.attribute if a.name == "value"), None)
        stub_type = value.data_type if value is not None else TensorProto.FLOAT
        to = next((helper.get_attribute_value(a) for a in cast.attribute if a.name == "to"), None) if cast else None
        out[layer] = Stub(node, [n for n in (cast, expand, zero, shape) if n is not None],
                          stub_type, to if to is not None else stub_type)
    missing = sorted(set(linears) - set(out))
    if missing:
        from .errors import ONNXExportError

        raise ONNXExportError(f"the traced ONNX graph has no MatMul for {missing[0]}")
    return out


class Stub:
    """A linear's place in the traced graph: ``matmul``, the ``nodes`` that make its zero weight,
    the weight's type in the trace (``stub_type``) and the type the MatMul multiplies it in (``type``)."""

    def __init__(self, matmul, nodes, stub_type: int, type_: int):
        self.matmul, self.nodes, self.stub_type, self.type = matmul, nodes, stub_type, type_

    def weight(self, w_t: np.ndarray) -> np.ndarray:
        """The fp32 (in, out) weight as this graph holds it: in the trace's type, then the MatMul's
        (an fp16 export's fp32 MatMul reads the fp16 weight cast back, as torch.onnx folds it)."""
        from onnx import helper

        w_t = w_t.astype(helper.tensor_dtype_to_np_dtype(self.stub_type), copy=False)
        return w_t.astype(helper.tensor_dtype_to_np_dtype(self.type), copy=False)


def replace_stubs(model, stubs: dict, replacements: dict) -> None:
    """Rewrite the graph: each stub in ``replacements`` (linear -> (new nodes, new initializers))
    takes its MatMul's place; its Expand and Constants go."""
    drop = set()
    at = {}
    for layer, stub in stubs.items():
        if layer not in replacements:
            continue
        drop.update(id(n) for n in stub.nodes)
        at[id(stub.matmul)] = replacements[layer]
    nodes, inits = [], []
    for node in model.graph.node:
        if id(node) in drop:
            continue
        if id(node) in at:
            new_nodes, new_inits = at[id(node)]
            nodes.extend(new_nodes)
            inits.extend(new_inits)
        else:
            nodes.append(node)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    model.graph.initializer.extend(inits)


def weight_replacement(stub: Stub, layer: str, weight_t: np.ndarray | None, tied_to: str | None = None):
    """A stub's MatMul with the (in, out) weight ``weight_t`` as an initializer, or for a tied head
    the embedding ``tied_to`` through a Transpose (optimum's tied-weight layout; then a Cast where
    the MatMul multiplies in another type than the embedding's)."""
    from onnx import helper, numpy_helper

    matmul = stub.matmul
    if tied_to is not None:
        scope = "/" + layer.replace(".", "/")
        t_out = f"{tied_to}_transposed"
        nodes = [helper.make_node("Transpose", [tied_to], [t_out], name=scope + "/Transpose")]
        if stub.type != stub.stub_type:
            nodes.append(helper.make_node("Cast", [t_out], [t_out + "_cast"], name=scope + "/Cast", to=stub.type))
            t_out += "_cast"
        nodes.append(helper.make_node("MatMul", [matmul.input[0], t_out], list(matmul.output), name=matmul.name))
        return nodes, []
    name = f"{layer}.weight_t"
    mm = helper.make_node("MatMul", [matmul.input[0], name], list(matmul.output), name=matmul.name)
    return [mm], [numpy_helper.from_array(np.ascontiguousarray(weight_t), name)]


def nbits_replacement(matmul, layer: str, k: int, n: int, bits: int, bs: int, b, s, zp, accuracy_level: int):
    """A stub's MatMul as ``com.microsoft::MatMulNBits`` over the packed codes ``b``, scales ``s``, zero points ``zp``."""
    from onnx import helper, numpy_helper

    base = f"{layer}.weight"
    tensors = [numpy_helper.from_array(b, base + "_Q"), numpy_helper.from_array(s, base + "_scales")]
    if zp is not None:
        tensors.append(numpy_helper.from_array(zp, base + "_zp"))
    node = helper.make_node("MatMulNBits", [matmul.input[0], *(t.name for t in tensors)], list(matmul.output),
                            name=matmul.name + "NBits", domain="com.microsoft", K=k, N=n, bits=bits, block_size=bs,
                            accuracy_level=accuracy_level)
    return [node], tensors
