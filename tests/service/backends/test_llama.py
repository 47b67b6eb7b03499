"""The llama.cpp backend over a tiny random GGUF model (tests/gguf_model.py): the mode's grammar
holds whatever the weights, and the AR route answers through it over real HTTP."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from service.artifacts.bundle import Bundle, load_bundle, verify_bundle
from service.backends.llama import LlamaConfig, LlamaCppFanoutBackend
from service.errors import BundleError, DeadlineError, UnavailableError
from service.fanout.candidates import Candidates
from service.fanout.format import (
    PromptBuilder,
    build_prompt,
    prompt_context,
    prompt_query,
)
from service.fanout.instruction import (
    MAX_NAME_CHARS,
    MAX_QUESTION_CHARS,
    MULTIQUERY_LINES,
    grammar,
)
from service.runtime.encoder import Encoder
from tests.gguf_model import CHAT_TEMPLATE, write_tiny_gguf
from tests.service.bundles import LLM_CONTEXT, LLM_K
from tests.service.live import live_server, make_settings

K, CONTEXT = LLM_K, LLM_CONTEXT


@pytest.fixture(scope="module")
def prompts(llm_bundle: Path, benchmark_queries) -> list[str]:
    bundle: Bundle = load_bundle(llm_bundle)
    texts = [q.query for q in benchmark_queries[:3]]
    queries = Encoder(bundle.encoder_config).encode(texts)  # (3, d)
    builder = PromptBuilder(Candidates.of(bundle, "hybrid"), bundle.items.texts, CONTEXT)
    return builder.prompts(texts, queries)


def backend(gguf: Path, mode: str, k: int = K) -> LlamaCppFanoutBackend:
    """Random weights write byte-level junk: a budget that holds k lines of it."""
    config = LlamaConfig(mode=mode, k=k, context=CONTEXT,
                         max_new_tokens=k * MAX_QUESTION_CHARS * 2, n_ctx=4096)
    return LlamaCppFanoutBackend(gguf, config, threads=1)


def test_names_mode_writes_k_of_the_prompts_own_names(tiny_gguf, prompts):
    llm = backend(tiny_gguf, "names")
    generations = llm.generate(prompts)
    llm.close()
    assert len(generations) == len(prompts)
    for prompt, generation in zip(prompts, generations, strict=True):
        lines = generation.text.strip("\n").split("\n")
        names = set(prompt_context(prompt))
        assert len(names) >= K
        assert len(lines) == K and set(lines) <= names
        assert generation.n_tokens > 0


def test_free_and_multiquery_modes_write_their_line_counts(tiny_gguf, prompts):
    for mode, lines, chars in (("free", K, MAX_NAME_CHARS),
                               ("multiquery", MULTIQUERY_LINES, MAX_QUESTION_CHARS)):
        llm = backend(tiny_gguf, mode)
        for generation in llm.generate(prompts[:2]):
            written = generation.text.split("\n")
            assert len(written) == lines
            assert all(0 < len(line) <= chars and line[0] not in " \t<>" for line in written)
            if mode == "free":  # a name, not a sentence
                assert not any(set(line) & set(".:;!?()<>") for line in written)
        llm.close()


def test_n_samples_of_a_prompt_each_take_their_own_seed(tiny_gguf, prompts):
    """Stage 2's use: the j-th sample is drawn with seed + j, so n samples are not n copies."""
    config = LlamaConfig(mode="free", k=K, context=CONTEXT, temperature=1.0,
                         max_new_tokens=K * MAX_NAME_CHARS * 2, n_ctx=4096)
    llm = LlamaCppFanoutBackend(tiny_gguf, config, threads=1)
    samples = [g.text for g in llm.generate(prompts[:1], n=3, seed=11)]
    again = [g.text for g in llm.generate(prompts[:1], n=2, seed=12)]
    llm.close()
    assert len(samples) == 3 and len(set(samples)) > 1
    assert again == samples[1:]  # seed 12 and 13


def test_names_the_grammar_must_escape_are_written_as_they_are(tiny_gguf):
    names = ['say "hi"', "back\\slash", "café", "naïve art", "C++"]
    llm = backend(tiny_gguf, "names", k=3)
    text = llm.generate([build_prompt("odd names", names)])[0].text
    llm.close()
    assert len(text.split("\n")) == 3 and set(text.split("\n")) <= set(names)


def test_a_closed_backend_refuses_and_a_bad_config_is_refused(tiny_gguf, prompts):
    llm = backend(tiny_gguf, "names")
    llm.close()
    llm.close()  # idempotent
    with pytest.raises(UnavailableError, match="closed"):
        llm.generate(prompts[:1])
    with pytest.raises(BundleError, match="context ≥ k"):
        LlamaConfig(mode="names", k=10, context=5)
    with pytest.raises(BundleError, match="unknown mode"):
        LlamaConfig(mode="poetry")


def test_a_gguf_with_a_chat_template_is_prompted_through_it(prompts, tmp_path):
    gguf = write_tiny_gguf(tmp_path / "chat.gguf", chat_template=CHAT_TEMPLATE)
    chat = LlamaCppFanoutBackend(gguf, LlamaConfig(context=CONTEXT, max_new_tokens=2000),
                                 threads=1)
    assert chat.prompting == "chat"
    head = chat._head(prompt_query(prompts[0]), prompt_context(prompts[0]))
    assert head.startswith("<s>user: ") and head.endswith("<s>assistant: ")
    lines = chat.generate(prompts[:1])[0].text.split("\n")
    chat.close()
    assert len(lines) == K and set(lines) <= set(prompt_context(prompts[0]))


def test_greedy_decoding_repeats_itself(tiny_gguf, prompts):
    llm = backend(tiny_gguf, "names")
    first, again = llm.generate(prompts[:1]), llm.generate(prompts[:1])
    llm.close()
    assert first[0].text == again[0].text


def spy_completions(llm: LlamaCppFanoutBackend) -> list[dict[str, Any]]:
    """The completions llama.cpp returns to the backend, recorded as they come back."""
    returned: list[dict[str, Any]] = []
    complete = llm.llm.create_completion

    def recorded(*args: Any, **kwargs: Any) -> Any:
        returned.append(complete(*args, **kwargs))
        return returned[-1]

    llm.llm.create_completion = recorded
    return returned


def test_a_passed_deadline_starts_no_completion(tiny_gguf, prompts):
    """Issue 41 item 3: a batch whose deadline passed is not decoded (a 504); an unbounded
    or distant one is decoded as before."""
    llm = backend(tiny_gguf, "names")
    returned = spy_completions(llm)
    try:
        with pytest.raises(DeadlineError, match=r"llama\.cpp decoding"):
            llm.generate(prompts[:2], deadline=time.monotonic() - 1.0)
        assert returned == []
        unbounded = llm.generate(prompts[:1], deadline=None)
        distant = llm.generate(prompts[:1], deadline=time.monotonic() + 60.0)
    finally:
        llm.close()
    assert len(unbounded[0].text.split("\n")) == K
    assert distant[0].text == unbounded[0].text


def test_a_deadline_passing_mid_completion_cuts_it(tiny_gguf):
    """A completion far longer than the time left (many free lines) is stopped at the deadline
    by the stopping criterion, unfinished, and the batch fails with DeadlineError instead of
    returning text."""
    lines = 100  # thousands of tokens: seconds of decoding, far past the deadline below
    llm = LlamaCppFanoutBackend(tiny_gguf, LlamaConfig(
        mode="free", k=lines, context=CONTEXT, max_new_tokens=lines * MAX_NAME_CHARS * 2,
        n_ctx=lines * MAX_NAME_CHARS * 2 + 1024), threads=1)
    returned = spy_completions(llm)
    try:
        with pytest.raises(DeadlineError, match=r"llama\.cpp decoding"):
            llm.generate([build_prompt("tree")], deadline=time.monotonic() + 0.3)
    finally:
        llm.close()
    assert len(returned) == 1  # started before the deadline
    assert returned[0]["choices"][0]["text"].count("\n") < lines - 1  # and cut short


def test_grammar_escapes_names_and_counts_lines():
    text = grammar("names", ['say "hi"', "back\\slash", "say \"hi\""], 3)
    assert text.count('line "\\n"') == 2
    assert '"say \\"hi\\""' in text and '"back\\\\slash"' in text
    assert text.count("say") == 1  # a repeated name is one alternative
    assert "[^\\n" in grammar("names", [], 3)  # no names: free lines


def test_prompt_query_reads_the_first_line(prompts, benchmark_queries):
    assert prompt_query(prompts[0]) == " ".join(benchmark_queries[0].query.split())


def test_bundle_records_the_gguf_stage(llm_bundle, tiny_gguf):
    manifest = verify_bundle(llm_bundle)
    record = manifest["stages"]["llm"]
    assert record["files"] == ["llm/llm.json", "llm/model.gguf"]
    assert (llm_bundle / "llm" / "model.gguf").read_bytes() == tiny_gguf.read_bytes()


def test_ar_route_answers_through_llama_cpp(llm_bundle):
    settings = make_settings(llm_bundle, None, routes="ar=1", warmup_queries=1)
    with live_server(settings) as server, server.client() as client:
        info = client.get("/v1/info").json()
        answer = client.post("/v1/retrieve", json={"query": "tree", "k": K, "route": "ar"})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["route"] == "ar" and not body["fallback"]["used"]
    assert len({item["id"] for item in body["items"]}) == K
    assert body["timings_ms"]["decode"] > 0
    assert len(body["subqueries"]) == K  # the grammar's k names, none malformed or repeated
    assert not any("malformed" in note for note in body["notes"])
    assert info["served"]["paths"]["ar"]["backend"] == "llama.cpp"
    assert np.isfinite(body["groundedness"])
