"""The ONNX graph without the model's linear weights, and the weights placed into it one at a time.

The decoder is traced with torch.onnx's TorchScript exporter around the model itself, its KV cache
made explicit (:func:`trace_decoder`): ``input_ids``, ``attention_mask``, ``position_ids`` and
``past_key_values.N.key/value`` in; ``logits`` and ``present.N.key/value`` out, present being the
past with the new positions appended (the layout onnxruntime-genai's builder and optimum's exporter
also write). The trace needs only the shapes, and a model whole costs its fp32 copy, torch.onnx's
constant-folded transposes of every weight and the serialized proto (about five times the fp32
model). So the traced model has every ``nn.Linear`` replaced by a :class:`StubLinear`, which holds no
weight (its bias, if any, stays a real parameter): in the trace it returns zeros of the output's
shape, and in the ONNX graph it is ``MatMul(x, Expand(0, [in, out]))``, a valid graph that holds no
weight bytes. Everything else (embeddings, norms, biases, rotary buffers) is read from the source as
the full model would have it; node names are the modules' (``/model/layers.0/self_attn/q_proj/MatMul``).

Then each stub becomes, in place, either ``MatMulNBits`` built from the artifact's codes (read
one linear at a time from ``quantization.safetensors``), or a ``MatMul`` with the linear's
transposed weight read from the source (fp32, or fp16 for an fp16 export) as an initializer,
exactly the constant torch.onnx folds from the whole model; a tied head reads the embedding
through a ``Transpose``. Peak memory is the interpreter, the small tensors, the largest single
linear and what the file itself holds.
"""

from __future__ import annotations

import warnings
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
                    # leaves alone (benchmarks/onnx_memory.py; git show 5f8f6c1:scripts/bench/onnx_stub_fold.py).
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
        # eager attention: its mask is built for every input (sdpa may leave it out when a traced input
        # happens to need none, and the graph would then never mask)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager")
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
    model.config._name_or_path = str(path)
    model.eval()
    return model, linears, tied


# What the traced decoder takes and gives (names as optimum's exporter and onnxruntime-genai's builder write them).
INPUTS = ("input_ids", "attention_mask", "position_ids")
PAST = "past_key_values.{}.{}"
PRESENT = "present.{}.{}"


def trace_decoder(model, path: Path, opset: int = 17) -> None:
    """Trace ``model`` (a causal LM, usually :func:`build_stub_model`'s) into the ONNX file ``path`` with its
    KV cache as inputs and outputs, every length dynamic (batch, new tokens, past tokens).

    The model's own forward runs inside, on a ``DynamicCache`` filled from the past inputs (one full
    layer per decoder block: sliding-window layers are given the whole past and mask it, so present is
    always the past plus the new positions, for every layer)."""
    import torch
    from transformers import DynamicCache

    config = model.config
    layers = int(config.num_hidden_layers)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    dtype = next(t.dtype for t in model.parameters() if t.is_floating_point())
    class_forward = type(model).forward

    def flat_forward(input_ids, attention_mask, position_ids, *past):
        cache = DynamicCache()
        for i in range(layers):
            cache.update(past[2 * i], past[2 * i + 1], i)
        out = class_forward(model, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            past_key_values=cache, use_cache=True)
        present = []
        for layer in out.past_key_values.layers:
            present += [layer.keys, layer.values]
        return (out.logits, *present)

    kv = [(i, which) for i in range(layers) for which in ("key", "value")]
    inputs = [*INPUTS, *(PAST.format(i, w) for i, w in kv)]
    outputs = ["logits", *(PRESENT.format(i, w) for i, w in kv)]
    axes = {"input_ids": {0: "batch_size", 1: "sequence_length"},
            "attention_mask": {0: "batch_size", 1: "total_sequence_length"},
            "position_ids": {0: "batch_size", 1: "sequence_length"},
            "logits": {0: "batch_size", 1: "sequence_length"}}
    axes.update({PAST.format(i, w): {0: "batch_size", 2: "past_sequence_length"} for i, w in kv})
    axes.update({PRESENT.format(i, w): {0: "batch_size", 2: "total_sequence_length"} for i, w in kv})
    batch, new, old = 2, 5, 3  # lengths of the example inputs; each is a dynamic axis of the graph
    ids = torch.randint(0, int(config.vocab_size), (batch, new), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(batch, old + new, dtype=torch.int64)
    positions = torch.arange(old, old + new).expand(batch, new)
    past = [torch.zeros(batch, kv_heads, old, head_dim, dtype=dtype) for _ in kv]
    model.forward = flat_forward  # an instance attribute: nn.Module.__call__ finds it first
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the TorchScript tracer's notes on Python values it records
            torch.onnx.export(model, (ids, mask, positions, *past), str(path), input_names=inputs, output_names=outputs,
                              dynamic_axes=axes, opset_version=opset, dynamo=False, do_constant_folding=True)
    finally:
        del model.forward


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
    the embedding ``tied_to`` through a Transpose (then a Cast where
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
