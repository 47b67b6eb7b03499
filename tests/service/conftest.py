"""Service test fixtures: a small real serving bundle, a stand-in completion server, and live
uvicorn servers on 127.0.0.1.

The serving bundle is the session's small WordNet bundle (tests/conftest.py) plus a real
`diffusion/` stage exported by `r4t export diffusion`'s code from a tiny denoiser trained for
a few steps: shaped as the `standalone` student's (rows = k = 10, a context of the query's
nearest mentions then its nearest items, with their mention features, one draw of one Euler
step: the route serves with no ranker), smaller (16 context items, the `tiny` width). Only
the bundles whose sampler misbehaves on purpose (`broken_bundle`, `fragile_bundle`) carry a
hand-built toy graph instead (`sampler_graph`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import onnx
import pytest
from onnx import TensorProto, helper

from service.api.app import create_app
from service.api.server import listening, server_for
from service.artifacts.bundle import config_hash, read_manifest, stage, write_manifest
from service.loopback import free_port, wait_ready
from service.settings import Settings
from training.data.splits import BenchmarkQuery

ROWS = 10  # rows = k, as the default bundle's sampler
DIM = 128
CONTEXT = 16  # the served sampler attends to 16 items: its query's nearest mentions, then nearest
CONTEXT_SOURCE = "mentioned"
DRAWS = 1
SOLVER, STEPS = "euler", 1
TRAIN_STEPS = 4
NOISE_SCALE = 0.05  # the toy graph's
ADMIN_TOKEN = "test-admin-token"
WAIT_S = 60.0  # bound on a test's wait for a condition; reached only when something is broken
HOLD_LIMIT_S = 60.0  # the stand-in completion server answers 503 after holding this long
MALFORMED_MARK = "malformed"
ENGINE = os.environ.get("R4T_INDEX", "").startswith("milvus")  # serve from Milvus Lite


def sampler_graph(broken: bool = False, fail_above: int | None = None) -> onnx.ModelProto:
    """query (B, d), noise (B, L, d) → rows (B, L, d) = normalize(noise·s + query): a toy that
    follows contract 4, kept only to build samplers that fail on purpose, which a real export
    cannot be made to do.

    broken=True reshapes the noise to an impossible shape: loads fine, fails on every run.
    fail_above=n reads entry B-1 of a length-n vector: fails only on batches larger than n.
    """
    query = helper.make_tensor_value_info("query", TensorProto.FLOAT, ["B", DIM])
    noise = helper.make_tensor_value_info("noise", TensorProto.FLOAT, ["B", ROWS, DIM])
    rows = helper.make_tensor_value_info("rows", TensorProto.FLOAT, ["B", ROWS, DIM])
    consts = [
        helper.make_tensor("axis1", TensorProto.INT64, [1], [1]),
        helper.make_tensor("scale", TensorProto.FLOAT, [], [NOISE_SCALE]),
        helper.make_tensor("eps", TensorProto.FLOAT, [], [1e-12]),
    ]
    source = "noise"
    nodes = []
    if fail_above is not None:  # gather entry B-1 of a length-n vector of zeros
        consts += [helper.make_tensor("zeros", TensorProto.FLOAT, [fail_above],
                                      [0.0] * fail_above),
                   helper.make_tensor("one", TensorProto.INT64, [1], [1])]
        nodes += [
            helper.make_node("Shape", ["noise"], ["batch"], end=1),  # (1,): B
            helper.make_node("Sub", ["batch", "one"], ["last"]),  # (1,): B - 1
            helper.make_node("Gather", ["zeros", "last"], ["zero"], axis=0),  # (1,) or error
            helper.make_node("Add", ["noise", "zero"], ["noise_checked"]),  # (B, L, d)
        ]
        source = "noise_checked"
    if broken:
        consts.append(helper.make_tensor("tail", TensorProto.INT64, [2], [7, -1]))
        nodes += [  # a shape known only at run time, so the model loads and then fails
            helper.make_node("Shape", ["noise"], ["full"], end=1),  # (1,): B
            helper.make_node("Concat", ["full", "tail"], ["bad_shape"], axis=0),  # [B, 7, -1]
            helper.make_node("Reshape", ["noise", "bad_shape"], ["noise_bad"]),
        ]
        source = "noise_bad"
    nodes += [
        helper.make_node("Unsqueeze", ["query", "axis1"], ["q3"]),  # (B, 1, d)
        helper.make_node("Mul", [source, "scale"], ["scaled"]),  # (B, L, d)
        helper.make_node("Add", ["scaled", "q3"], ["shifted"]),  # (B, L, d)
        helper.make_node("ReduceL2", ["shifted"], ["norm"], axes=[-1], keepdims=1),  # (B, L, 1)
        helper.make_node("Max", ["norm", "eps"], ["safe"]),
        helper.make_node("Div", ["shifted", "safe"], ["rows"]),
    ]
    graph = helper.make_graph(nodes, "toy_sampler", [query, noise], [rows], initializer=consts)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def add_diffusion_stage(
    bundle_dir: Path, broken: bool = False, fail_above: int | None = None
) -> None:
    """Commit a toy diffusion/sampler.onnx + diffusion/diffusion.json into the bundle."""
    manifest = read_manifest(bundle_dir)
    manifest["name"] = bundle_dir.name
    config = {
        "rows": ROWS, "k": ROWS, "dim": DIM, "solver": "none (test stand-in)", "steps": 0,
        "cfg_weight": 0.0, "cfg_formula": "none", "sigma_min": 0.0, "sigma_max": NOISE_SCALE,
        "params": 0, "flops_per_query": 4 * ROWS * DIM, "preset": "test-broken" if broken
        else "test",
    }
    record = {"config": config, "config_hash": config_hash(config), "wall_s": 0.0}
    with stage(bundle_dir, manifest, "diffusion", record) as staged:
        (staged / "diffusion").mkdir()
        onnx.save(sampler_graph(broken, fail_above), staged / "diffusion" / "sampler.onnx")
        (staged / "diffusion" / "diffusion.json").write_text(json.dumps(config))


def export_tiny_diffusion(bundle_dir: Path, run_dir: Path) -> dict[str, Any]:
    """Train the tiny denoiser a few steps with the default bundle's context, export its
    sampler as the default bundle's is, and commit it into the bundle; its diffusion.json."""
    import torch

    from tests.training.stage3_diffusion.proxy_dataset import tiny_checkpoint
    from training.stage3_diffusion.export import ExportConfig, export_diffusion

    torch.set_num_threads(1)
    # one block and a few training steps keep the session's setup short (the dynamo export
    # of one step graph dominates it); ordered rows and a "mentioned" context with its items'
    # mention features, as the `standalone` preset
    checkpoint = tiny_checkpoint(run_dir, rows=ROWS, steps=TRAIN_STEPS, context=CONTEXT,
                                 context_source=CONTEXT_SOURCE, ordered=True, layers=1,
                                 mentions=True)
    return export_diffusion(bundle_dir, checkpoint,
                            ExportConfig(solver=SOLVER, steps=STEPS, draws=DRAWS))


@pytest.fixture(scope="session")
def serving_bundle(small_bundle_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The small real catalog plus a real tiny diffusion export (see the module docstring);
    named "svc". The training run lives outside the bundle, so copies of it stay small."""
    root = tmp_path_factory.mktemp("serving")
    target = root / "svc"
    shutil.copytree(small_bundle_dir, target)
    manifest = read_manifest(target)
    manifest["name"] = target.name
    write_manifest(target, manifest)
    config = export_tiny_diffusion(target, root / "run")
    assert (config["rows"], config["context"], config["context_source"], config["draws"],
            config["claims"]) == (ROWS, CONTEXT, CONTEXT_SOURCE, DRAWS, "pointers")
    return target


@pytest.fixture(scope="session")
def broken_bundle(small_bundle_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The toy sampler graph, built to load and then fail on every run (warm-up drops it): a
    real export cannot be made to misbehave this way."""
    target = tmp_path_factory.mktemp("serving") / "broken"
    shutil.copytree(small_bundle_dir, target)
    add_diffusion_stage(target, broken=True)
    return target


@pytest.fixture(scope="session")
def fragile_bundle(small_bundle_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The toy sampler graph, built to work on batches of up to 2 queries and fail on larger
    ones: a run-time failure a real export cannot be made to have."""
    target = tmp_path_factory.mktemp("serving") / "fragile"
    shutil.copytree(small_bundle_dir, target)
    add_diffusion_stage(target, fail_above=2)
    return target


@pytest.fixture(scope="session")
def benchmark_queries(small_sources: tuple[Path, Path]) -> list[BenchmarkQuery]:
    _, benchmark = small_sources
    queries = []
    for line in benchmark.read_text().splitlines():
        record = json.loads(line)
        queries.append(BenchmarkQuery(record["query"], record["groups"], record.get("id")))
    return queries


def _opened() -> threading.Event:
    event = threading.Event()
    event.set()
    return event


@dataclass
class CompletionServerState:
    """What the stand-in endpoint answers, and how it misbehaves on request.

    Between `hold()` and `release()` (`holding_completions`), every completion request waits,
    counted in `held`: a test keeps the AR path busy for exactly as long as it needs, however
    fast the machine is.
    """

    fanouts: dict[str, list[str]]
    fail_next: int = 0  # answer this many requests with 503 first
    requests: int = 0
    held: int = 0  # requests waiting on `open` now
    prompts: list[str] = field(default_factory=list)
    bodies: list[dict[str, Any]] = field(default_factory=list)  # every answered request's
    lock: threading.Lock = field(default_factory=threading.Lock)
    open: threading.Event = field(default_factory=_opened)

    def hold(self) -> None:
        self.open.clear()

    def release(self) -> None:
        self.open.set()

    def completion(self, prompt: str) -> str:
        query = prompt.removeprefix("query: ").split("\n", 1)[0]
        if MALFORMED_MARK in query:
            return "just one line\n\n\nthen garbage " + "x" * 300
        lines = self.fanouts.get(query) or [f"{query} {n}" for n in range(1, 11)]
        return "\n".join(lines)


class _CompletionHandler(BaseHTTPRequestHandler):
    state: CompletionServerState

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length", 0))
        body = json.loads(self.rfile.read(length))
        with self.state.lock:
            self.state.requests += 1
            failing = self.state.fail_next > 0
            self.state.fail_next -= int(failing)
        if failing:
            self._send(503, {"error": "warming up"})
            return
        with self.state.lock:
            self.state.held += 1
        try:
            released = self.state.open.wait(HOLD_LIMIT_S)
        finally:
            with self.state.lock:
                self.state.held -= 1
        if not released:
            self._send(503, {"error": f"held for over {HOLD_LIMIT_S} s: a test never released it"})
            return
        prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
        self.state.prompts.extend(prompts)
        self.state.bodies.append(body)
        n = int(body.get("n", 1))
        texts = [self.state.completion(p) for p in prompts for _ in range(n)]
        choices = [{"index": i, "text": text, "finish_reason": "stop"}
                   for i, text in enumerate(texts)]
        usage = {"completion_tokens": sum(len(text.split()) for text in texts)}
        self._send(200, {"object": "text_completion", "model": body.get("model"),
                         "choices": choices, "usage": usage})

    def _send(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (its deadline)
            return

    def log_message(self, *args: Any) -> None:
        return None


@dataclass
class CompletionServer:
    url: str
    state: CompletionServerState


@contextmanager
def holding_completions(server: CompletionServer) -> Iterator[CompletionServerState]:
    """Completion requests wait until the block ends or `state.release()` is called (or
    HOLD_LIMIT_S passed). Release before a live server in the block shuts down, or its
    shutdown waits on the held batch."""
    server.state.hold()
    try:
        yield server.state
    finally:
        server.state.release()


def wait_until(predicate: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    """Poll a condition that has no event to wait on, with a bounded deadline."""
    stop = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > stop:
            raise AssertionError(f"{what}: not so after {timeout_s} s")
        time.sleep(0.01)


@pytest.fixture(scope="session")
def completion_server(
    benchmark_queries: list[BenchmarkQuery], wordnet_synsets: dict
) -> Iterator[CompletionServer]:
    """An OpenAI-compatible /v1/completions stand-in on loopback (real HTTP).

    For a benchmark query it answers with the first lemmas of ten of the query's direct
    hyponym branches, i.e. a plausible fan-out; for any other query, "<query> 1..10".
    """
    fanouts = {}
    for q in benchmark_queries:
        heads = [g[0] for g in q.groups]
        deeper = [member for g in q.groups for member in g[1:]]
        lemmas = dict.fromkeys(wordnet_synsets[o].lemmas[0] for o in heads + deeper)
        lemmas.pop(q.query, None)
        fanouts[q.query] = list(lemmas)[:10]
    state = CompletionServerState(fanouts=fanouts)
    handler = type("Handler", (_CompletionHandler,), {"state": state})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield CompletionServer(f"http://127.0.0.1:{server.server_address[1]}/v1", state)
    server.shutdown()
    server.server_close()


@dataclass
class LiveServer:
    url: str
    app: Any

    def client(self, **kwargs: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=30.0, **kwargs)


def asked(completion: CompletionServer, query: str) -> int:
    """Completion requests the AR route has sent for `query`."""
    return sum(p.startswith(f"query: {query}\n") for p in completion.state.prompts)


@contextmanager
def live_server(settings: Settings, ready: bool = True) -> Iterator[LiveServer]:
    """create_app(settings) under r4t serve's uvicorn server on 127.0.0.1 (a free port), in a
    thread (signals stay with the test process: SIGTERM is tested on `serve_process`)."""
    app = create_app(settings)
    sock = listening("127.0.0.1", 0)
    sockets = [sock] if settings.admin_port is None else [
        sock, listening("127.0.0.1", settings.admin_port)]  # as r4t serve binds them
    server = server_for(settings, app)  # r4t serve's own server: limits, receive deadline
    thread = threading.Thread(target=server.run, kwargs={"sockets": sockets}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        stop = time.monotonic() + 30
        while not server.started and time.monotonic() < stop:
            time.sleep(0.01)
        if ready:
            wait_ready(f"{url}/readyz", 120.0, poll_s=0.05)
        yield LiveServer(url, app)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        for bound in sockets:
            bound.close()


@contextmanager
def server_process(bundle: Path, completion: CompletionServer, log: Path,
                   **env: str) -> Iterator[tuple[str, subprocess.Popen]]:
    """`r4t serve` of `bundle` as a subprocess on loopback (R4T_* overrides in `env`), ready;
    yields (url, process) and stops it (SIGTERM) afterwards if it still runs."""
    port = free_port()
    environment = {**os.environ, "R4T_BUNDLE": str(bundle), "R4T_PORT": str(port),
                   "R4T_HOST": "127.0.0.1", "R4T_OPENAI_BASE_URL": completion.url,
                   "R4T_THREADS": "1", "R4T_DRAIN_S": "0", "R4T_FANOUT_THRESHOLD": "0",
                   **env}
    with log.open("w") as handle:
        process = subprocess.Popen([sys.executable, "-m", "service.command", "serve"],
                                   env=environment, stdout=handle, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_ready(f"{url}/readyz", 120.0, process)
            yield url, process
        finally:
            if process.poll() is None:
                process.terminate()
                process.wait(timeout=30)


@contextmanager
def serve_process(bundle: Path, completion: CompletionServer, log: Path,
                  **env: str) -> Iterator[tuple[str, int]]:
    """`server_process`, yielding (url, port)."""
    with server_process(bundle, completion, log, **env) as (url, _):
        yield url, int(url.rsplit(":", 1)[1])


def make_settings(bundle: Path, completion: CompletionServer | None, **overrides: Any
                  ) -> Settings:
    base: dict[str, Any] = {
        "bundle": bundle, "threads": 1, "faiss_threads": 1, "warmup_queries": 2,
        "routes": "diffusion=0.5,ar=0.5", "admin_token": ADMIN_TOKEN,
        "openai_base_url": completion.url if completion else None,
        "openai_backoff_s": 0.01, "groundedness_threshold": 0.0,
        "fanout_threshold": 0.0,  # route=auto fans every query out unless a test sets one
        "fanout_cache_size": 0,  # tests count the fan-out model's requests; the cache's turn it on
        # admission refuses only a request the estimate says would miss its whole deadline: an
        # outcome a busy machine cannot flip (the admission tests set the estimate themselves)
        "admit_wait_fraction": 1.0,
        # the harness's index, so served answers compare with its own; R4T_INDEX=milvus
        # serves the same catalog from the engine (tests/conftest.py loads it there)
        "index": "milvus" if ENGINE else "bundle",
    }
    return Settings(**{**base, **overrides})


@pytest.fixture(scope="session")
def settings_for(
    serving_bundle: Path, completion_server: CompletionServer
) -> Callable[..., Settings]:
    def build(bundle: Path | None = None, **overrides: Any) -> Settings:
        return make_settings(bundle or serving_bundle, completion_server, **overrides)

    return build


@pytest.fixture(scope="session")
def server(settings_for: Callable[..., Settings]) -> Iterator[LiveServer]:
    """The main live service: both paths, 50/50 A/B, admin API on."""
    with live_server(settings_for()) as live:
        yield live


def shipped_settings(bundle: Path, completion: CompletionServer | None, **harness: Any
                     ) -> Settings:
    """`r4t serve`'s settings as shipped: every field at its default in service/settings.py,
    whatever R4T_* the environment holds (R4T_INDEX included), except what a harness must set:
    the bundle, the admin token, the completion endpoint of the AR route (the test bundles have
    no fan-out model of their own) and one ONNX Runtime thread (test workers share the cores).
    Admission, the groundedness gate, the fan-out trigger, the expansion cache, the index and
    the A/B weights stay as a deployment gets them."""
    defaults = {name: field.get_default(call_default_factory=True)
                for name, field in Settings.model_fields.items()}
    return Settings(**{**defaults, "bundle": bundle, "admin_token": ADMIN_TOKEN, "threads": 1,
                       "openai_base_url": completion.url if completion else None, **harness})


LLM_K, LLM_CONTEXT = 10, 16  # the tiny GGUF policy's fan-out and prompt names


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.gguf_model import write_tiny_gguf

    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture(scope="session")
def llm_bundle(small_bundle_dir: Path, tiny_gguf: Path,
               tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The small catalog with the tiny GGUF as its AR policy (names mode, 16 hybrid names)."""
    from service.backends.llama import LlamaConfig
    from service.fanout.instruction import MAX_QUESTION_CHARS
    from training.stage1_fanout.gguf import commit_llm

    target = tmp_path_factory.mktemp("llm") / "llm"
    shutil.copytree(small_bundle_dir, target)
    commit_llm(target, tiny_gguf, LlamaConfig(mode="names", k=LLM_K, context=LLM_CONTEXT,
                                              max_new_tokens=LLM_K * MAX_QUESTION_CHARS * 2,
                                              n_ctx=4096))  # random weights: byte-level names
    return target
