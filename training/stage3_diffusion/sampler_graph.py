"""The whole solver as one ONNX graph, composed from the exported step graph: unrolled (one
copy of the step's nodes per evaluation, sharing the weights) or an ONNX `Loop` whose body holds
the step; the last step is always unrolled, so a mixture head's weights are the graph's."""

from __future__ import annotations

from itertools import pairwise
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from service.runtime.sampler import CONTEXT_INPUT, WEIGHTS_OUTPUT
from training.stage3_diffusion.solvers import sigma_schedule, solver_evaluations

DENOISED_OUTPUT = "denoised"


class GraphWriter:
    """Appends nodes, constants and renamed copies of the step graph to a node list."""

    def __init__(self, step: onnx.ModelProto, nodes: list[onnx.NodeProto], prefix: str) -> None:
        self.step, self.nodes, self.prefix = step, nodes, prefix
        self.shared = {init.name for init in step.graph.initializer}
        self.count = 0
        self.weights: str | None = None  # the last inlined step's weights output, if any

    def name(self, hint: str) -> str:
        self.count += 1
        return f"{self.prefix}{hint}_{self.count}"

    def op(self, op_type: str, inputs: list[str], **attrs: Any) -> str:
        out = self.name(op_type.lower())
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=out, **attrs))
        return out

    def const(self, value: float | list[int], dtype: Any = np.float32) -> str:
        out = self.name("const")
        tensor = numpy_helper.from_array(np.asarray(value, dtype=dtype), out)
        self.nodes.append(helper.make_node("Constant", [], [out], name=out, value=tensor))
        return out

    def denoise(self, x: str, sigma_b: str, query: str) -> str | None:
        """Inline one copy of the step graph; returns the name of its `denoised` output (its
        weights output, when it has one, in `self.weights`); None for a projected step, whose
        one output is the weights."""
        copy = self.name("step") + "."
        bound = {"x": x, "sigma": sigma_b, "query": query}
        if step_context(self.step)[0]:
            # the sampler's own input of the same name (outer scope in a Loop body)
            bound[CONTEXT_INPUT] = CONTEXT_INPUT

        def rename(value: str) -> str:
            if not value or value in self.shared:
                return value
            return bound.get(value, copy + value)

        for node in self.step.graph.node:
            clone = onnx.NodeProto()
            clone.CopyFrom(node)
            clone.name = copy + node.name
            clone.input[:] = [rename(v) for v in node.input]
            clone.output[:] = [rename(v) for v in node.output]
            self.nodes.append(clone)
        outputs = {value.name: rename(value.name) for value in self.step.graph.output}
        self.weights = outputs.get(WEIGHTS_OUTPUT)
        return outputs.get(DENOISED_OUTPUT)


def emit_step(w: GraphWriter, heun: bool, sigma: str, sigma_next: str, x: str, query: str,
              batch: str) -> str:
    """One solver step from noise level `sigma` to `sigma_next` (scalar tensors): Euler's
    x + (σ' − σ)·(x − D(x; σ))/σ, plus Heun's correction with the slope at σ' when `heun`."""
    delta = w.op("Sub", [sigma_next, sigma])
    denoised = w.denoise(x, w.op("Expand", [sigma, batch]), query)  # (B, L, d)
    if denoised is None:  # a projected step: its weights are the sampler's output
        return x
    slope = w.op("Div", [w.op("Sub", [x, denoised]), sigma])
    x_euler = w.op("Add", [x, w.op("Mul", [slope, delta])])
    if not heun:
        return x_euler
    denoised_next = w.denoise(x_euler, w.op("Expand", [sigma_next, batch]), query)
    slope_next = w.op("Div", [w.op("Sub", [x_euler, denoised_next]), sigma_next])
    mean_slope = w.op("Mul", [w.op("Add", [slope, slope_next]), w.const(0.5)])
    return w.op("Add", [x, w.op("Mul", [mean_slope, delta])])


def _loop(w: GraphWriter, step: onnx.ModelProto, heun: bool, sigmas: str, n: int, x: str,
          query: str, batch: str) -> str:
    """An ONNX Loop of n steps over the σ table `sigmas`; the body reads outer-scope weights."""
    body_nodes: list[onnx.NodeProto] = []
    body = GraphWriter(step, body_nodes, "loop.")
    sigma = body.op("Gather", [sigmas, "iter"])
    sigma_next = body.op("Gather", [sigmas, body.op("Add", ["iter", body.const(1, np.int64)])])
    x_out = emit_step(body, heun, sigma, sigma_next, "x_in", query, batch)
    body_nodes.append(helper.make_node("Identity", ["cond_in"], ["cond_out"]))
    body_nodes.append(helper.make_node("Identity", [x_out], ["x_out"]))
    x_type = helper.make_tensor_value_info("x_in", TensorProto.FLOAT, None)
    graph = helper.make_graph(
        body_nodes, "solver_step",
        [helper.make_tensor_value_info("iter", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []), x_type],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("x_out", TensorProto.FLOAT, None)],
    )
    trip = w.const(n, np.int64)
    out = w.name("loop")
    w.nodes.append(helper.make_node("Loop", [trip, "", x], [out], name=out, body=graph))
    return out


def live_nodes(nodes: list[onnx.NodeProto], outputs: list[str]) -> list[onnx.NodeProto]:
    """The nodes `outputs` depend on, in order: the last step's mixture and Euler update are
    dead once the graph returns that step's weights alone (onnx.utils.Extractor misses what a
    Loop body reads from the outer graph)."""
    needed, kept = set(outputs), []
    for node in reversed(nodes):
        if any(name in needed for name in node.output):
            kept.append(node)
            needed.update(read_names(node))
    return kept[::-1]


def read_names(node: onnx.NodeProto) -> set[str]:
    """The values a node reads: its inputs and, for a Loop, what its body reads."""
    names = {name for name in node.input if name}
    for attribute in node.attribute:
        if attribute.type == onnx.AttributeProto.GRAPH:
            for inner in attribute.g.node:
                names |= read_names(inner)
    return names


def step_outputs(step: onnx.ModelProto) -> list[str]:
    return [value.name for value in step.graph.output]


def step_context(step: onnx.ModelProto) -> tuple[int, int]:
    """(C, width) of the step graph's `context` input (B, C, d [+ P]); (0, 0) without one."""
    for value in step.graph.input:
        if value.name == CONTEXT_INPUT:
            dims = value.type.tensor_type.shape.dim
            return int(dims[1].dim_value), int(dims[2].dim_value)
    return 0, 0


def sampler_inputs(rows: int, dim: int, context: tuple[int, int]) -> list[onnx.ValueInfoProto]:
    """query (B, d) [, context (B, C, d [+ P])], noise (B, L, d)."""
    inputs = [helper.make_tensor_value_info("query", TensorProto.FLOAT, ["batch", dim])]
    if context[0]:
        inputs.append(helper.make_tensor_value_info(CONTEXT_INPUT, TensorProto.FLOAT,
                                                    ["batch", *context]))
    inputs.append(helper.make_tensor_value_info("noise", TensorProto.FLOAT, ["batch", rows, dim]))
    return inputs


def compose_sampler(step: onnx.ModelProto, rows: int, dim: int, solver: str, steps: int,
                    sigma_min: float, sigma_max: float, form: str = "unrolled") -> onnx.ModelProto:
    """The whole solver as one graph: query (B,d) [, context (B,C,d) when the step graph takes
    one], noise (B,L,d) → rows (B,L,d), unit-norm, or for a mixture head (a step graph with
    weights) the last evaluation's weights (B,L,C), whose mixture of the context the rows are.
    The last step (to σ = 0) is always unrolled: Heun's is Euler's."""
    if form not in ("unrolled", "loop"):
        raise ValueError(f"form must be 'unrolled' or 'loop', got {form!r}")
    if solver_evaluations(solver, steps) != 1 and DENOISED_OUTPUT not in step_outputs(step):
        raise ValueError("a projected step returns its weights alone, and its mixture needs "
                         "the context's embeddings: it samples in one evaluation only")
    schedule = sigma_schedule(steps, sigma_min, sigma_max)
    nodes: list[onnx.NodeProto] = []
    w = GraphWriter(step, nodes, "sampler.")
    batch = w.op("Shape", ["query"], start=0, end=1)  # (1,) = [B]
    x = w.op("Mul", ["noise", w.const(schedule[0])])  # (B, L, d)
    heun = solver == "heun"
    initializers = list(step.graph.initializer)
    if form == "loop":
        table = numpy_helper.from_array(np.asarray(schedule, np.float32), "sampler.sigmas")
        initializers.append(table)
        looped = steps - 1
        x = _loop(w, step, heun, table.name, looped, x, "query", batch) if looped else x
        pairs = list(pairwise(schedule[looped:]))
    else:
        pairs = list(pairwise(schedule))
    for sigma, sigma_next in pairs:
        x = emit_step(w, heun and sigma_next > 0, w.const(sigma), w.const(sigma_next), x,
                      "query", batch)
    if w.weights is None:
        norm = w.op("Sqrt", [w.op("ReduceSum", [w.op("Mul", [x, x]), w.const([-1], np.int64)],
                                  keepdims=1)])
        nodes.append(helper.make_node("Div", [x, w.op("Max", [norm, w.const(1e-12)])], ["rows"],
                                      name="sampler.unit_rows"))
        outputs = [helper.make_tensor_value_info("rows", TensorProto.FLOAT, ["batch", rows, dim])]
    else:  # the rows are the weights' mixture of the context: the service mixes them
        nodes.append(helper.make_node("Identity", [w.weights], [WEIGHTS_OUTPUT],
                                      name="sampler.weights"))
        outputs = [helper.make_tensor_value_info(
            WEIGHTS_OUTPUT, TensorProto.FLOAT, ["batch", rows, step_context(step)[0]])]
        nodes[:] = live_nodes(nodes, [WEIGHTS_OUTPUT])
        read = set().union(*map(read_names, nodes))
        initializers = [init for init in initializers if init.name in read]
    graph = helper.make_graph(nodes, f"{solver}_{steps}_{form}",
                              sampler_inputs(rows, dim, step_context(step)), outputs,
                              initializer=initializers)
    model = helper.make_model(graph, opset_imports=list(step.opset_import),
                              producer_name="r4t")
    model.ir_version = step.ir_version
    onnx.checker.check_model(model)
    return model
