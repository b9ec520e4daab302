"""`python -m hypic.serve` as a real process on a free port, driven by the official openai client.

Checks compare the server with itself through independent paths: streamed vs whole text, /tokenize
vs usage, a stop string cut where the unstopped text has it, repeated prompts hitting the cache.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")  # a test extra; absent on the GPU image

ROOT = Path(__file__).resolve().parent.parent
NAME = "tiny"
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[subprocess.Popen, str]]:
    command = [sys.executable, "-m", "hypic.serve", "--device", "cpu", "--port", "0", "--max-model-len", "512",
               "--cpu-cache-bytes", "64MiB", "--served-model-name", NAME, "--log-level", "warning"]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    line = process.stdout.readline()  # the start-up line, or '' if it died
    match = re.search(r"at (http://\S+) on (\S+): KV cache (\d+) tokens", line)
    assert match, f"no start-up line; got {line!r}"
    yield process, match.group(1)
    if process.poll() is None:
        process.kill()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server[1] + "/v1", api_key="unused", max_retries=0, timeout=60)


def _root(client: openai.OpenAI) -> str:
    return str(client.base_url).removesuffix("/").removesuffix("/v1")


def _tokenize(client: openai.OpenAI, body: dict) -> int:
    return _token_ids_and_count(client, body)[1]


def _token_ids_and_count(client: openai.OpenAI, body: dict) -> tuple[list[int], int]:
    headers = {"Content-Type": "application/json"}
    request = urllib.request.Request(_root(client) + "/tokenize", data=json.dumps(body).encode(), headers=headers)
    with urllib.request.urlopen(request, timeout=30) as response:
        reply = json.loads(response.read())
    return reply["tokens"], reply["count"]


def _get(client: openai.OpenAI, path: str) -> str:
    with urllib.request.urlopen(_root(client) + path, timeout=30) as response:
        return response.read().decode()


def test_models_lists_the_served_name(client) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [NAME]
    assert client.models.retrieve(NAME).id == NAME


def test_completion_whole_and_streamed_agree(client) -> None:
    whole = client.completions.create(model=NAME, prompt="The quick brown fox", max_tokens=8, **GREEDY)
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 8
    assert whole.usage.prompt_tokens == _tokenize(client, {"prompt": "The quick brown fox"})
    chunks = list(client.completions.create(model=NAME, prompt="The quick brown fox", max_tokens=8, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == 8


def test_chat_whole_and_streamed_agree(client) -> None:
    whole = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=6, **GREEDY)
    message = whole.choices[0].message
    assert message.role == "assistant" and whole.usage.completion_tokens == 6
    assert whole.usage.prompt_tokens == _tokenize(client, {"messages": CHAT})
    chunks = list(client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=6, stream=True, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_completions_are_indexed(client) -> None:
    response = client.completions.create(model=NAME, prompt="Hello", max_tokens=4, n=2, seed=3,
                                         extra_body={"ignore_eos": True})
    assert sorted(c.index for c in response.choices) == [0, 1]
    assert response.usage.completion_tokens == 8
    chat = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=3, n=2, **GREEDY)
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content  # greedy: the same text


# the bundled model's trained format: it replies with text ("Answer: ..."), not only special tokens
NOTE_QUESTION = ("<|im_start|>user\nNote: Mark lives in Oslo. Anna works as a cook.\n"
                 "Question: Where does Mark live?<|im_end|>\n<|im_start|>assistant\n")


def test_stop_string_cuts_where_the_text_has_it(client) -> None:
    free = client.completions.create(model=NAME, prompt=NOTE_QUESTION, max_tokens=24, **GREEDY).choices[0].text
    stop = next(free[i:i + 2] for i in range(2, len(free) - 1) if free[i:i + 2].strip())
    cut = client.completions.create(model=NAME, prompt=NOTE_QUESTION, max_tokens=24, stop=[stop], **GREEDY)
    assert cut.choices[0].text == free[: free.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_logprobs_in_both_formats(client) -> None:
    # three text tokens ("Answer", ":", " <city>"): a special token is in `tokens` (as in vLLM) but not in the text
    legacy = client.completions.create(model=NAME, prompt=NOTE_QUESTION, max_tokens=3, logprobs=2, **GREEDY).choices[0]
    assert len(legacy.logprobs.tokens) == 3 and "".join(legacy.logprobs.tokens) == legacy.text
    for chosen, top, logprob in zip(legacy.logprobs.tokens, legacy.logprobs.top_logprobs, legacy.logprobs.token_logprobs):
        assert chosen in top and len(top) <= 3 and logprob <= 0
        assert logprob == pytest.approx(max(top.values()))  # greedy picks the most likely token
    chat = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=3, logprobs=True, top_logprobs=2,
                                          **GREEDY).choices[0]
    assert len(chat.logprobs.content) == 3
    assert all(len(entry.top_logprobs) == 2 and entry.logprob <= 0 for entry in chat.logprobs.content)


def test_repeated_prompt_reports_cached_tokens(client) -> None:
    prompt = "A long shared preamble about caching. " * 6
    first = client.completions.create(model=NAME, prompt=prompt, max_tokens=1, **GREEDY).usage
    again = client.completions.create(model=NAME, prompt=prompt, max_tokens=1, **GREEDY).usage
    assert first.prompt_tokens_details.cached_tokens == 0
    assert 0 < again.prompt_tokens_details.cached_tokens < again.prompt_tokens


def test_segments_are_reused_in_any_order(client) -> None:
    fox = "The red fox lives in the northern forest and hunts small mice at night. " * 2
    whale = "The blue whale swims in the cold southern ocean and eats krill all summer. " * 2
    first = client.completions.create(model=NAME, prompt=None, max_tokens=1,
                                      extra_body={"segments": ["Answer briefly.", fox, whale, "Where is the fox?"]})
    swapped = client.completions.create(model=NAME, prompt=None, max_tokens=1,
                                        extra_body={"segments": ["Answer briefly.", whale, fox, "What do whales eat?"]})
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert 0 < swapped.usage.prompt_tokens_details.cached_tokens < swapped.usage.prompt_tokens
    text = "<|segment|>".join(["Answer briefly.", whale, "Where is the whale?"])  # the separator form
    joined = client.completions.create(model=NAME, prompt=text, max_tokens=1).usage
    assert joined.prompt_tokens == _tokenize(client, {"prompt": text}) and joined.prompt_tokens_details.cached_tokens > 0
    pic = re.search(rf'^hypic_cached_prompt_tokens_total\{{kind="pic",model_name="{NAME}"\}} (\S+)$',
                    _get(client, "/metrics"), re.MULTILINE)
    assert pic and float(pic.group(1)) > 0


def test_max_tokens_zero_returns_an_empty_completion_with_usage(client) -> None:
    response = client.completions.create(model=NAME, prompt="warm up", max_tokens=0)
    assert response.choices[0].text == "" and response.usage.completion_tokens == 0
    assert response.usage.prompt_tokens > 0


def _hf_prompt_logprobs(ids: list[int]):
    """transformers' log_softmax over the tokenizer's vocabulary at each prompt position but the last."""
    import torch
    from engine_util import hf_model

    from hypic.engine.setup import BUNDLED_MODEL
    from hypic.engine.text.tokenizer import Tokenizer

    vocab = Tokenizer.from_dir(BUNDLED_MODEL).vocab_size
    with torch.no_grad():
        logits = hf_model(BUNDLED_MODEL)(input_ids=torch.tensor([ids])).logits[0, :-1, :vocab].double()
    return torch.log_softmax(logits, -1)


def test_echo_with_logprobs_scores_the_prompt_as_transformers_does(client) -> None:
    prompt = "The quick brown fox jumps over the lazy dog. " * 3
    ids, _ = _token_ids_and_count(client, {"prompt": prompt})
    choice = client.completions.create(model=NAME, prompt=prompt, max_tokens=0, echo=True, logprobs=2).choices[0]
    reference, got = _hf_prompt_logprobs(ids), choice.logprobs
    assert choice.text == prompt and len(got.tokens) == len(ids)
    assert got.token_logprobs[0] is None and got.top_logprobs[0] is None  # nothing predicts the first token
    expected = [float(reference[p, ids[p + 1]]) for p in range(len(ids) - 1)]
    assert got.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    for top, row in zip(got.top_logprobs[1:], reference, strict=True):  # the top 2, and the prompt token
        assert sorted(top.values(), reverse=True)[:2] == pytest.approx(row.topk(2).values.tolist(), abs=1e-4)
    offsets = [sum(len(token) for token in got.tokens[:i]) for i in range(len(ids))]
    assert got.text_offset == offsets


def test_vllm_prompt_logprobs_without_echo(client) -> None:
    prompt = "Once upon a time there was a fox."
    ids, _ = _token_ids_and_count(client, {"prompt": prompt})
    choice = client.completions.create(model=NAME, prompt=prompt, max_tokens=2, temperature=0.0,
                                       extra_body={"prompt_logprobs": 3}).choices[0]
    reference, got = _hf_prompt_logprobs(ids), choice.model_extra["prompt_logprobs"]
    assert got[0] is None and len(got) == len(ids) and not choice.text.startswith(prompt)
    for position, entry in enumerate(got[1:]):
        row, token = reference[position], ids[position + 1]
        assert entry[str(token)]["logprob"] == pytest.approx(float(row[token]), abs=1e-4)
        best = row.topk(3)
        assert [entry[str(int(t))]["rank"] for t in best.indices] == [1, 2, 3]
        assert [entry[str(int(t))]["logprob"] for t in best.indices] == pytest.approx(best.values.tolist(), abs=1e-4)


def test_echo_puts_the_prompt_before_each_choice_streamed_or_not(client) -> None:
    """Two prompts, n=2, a stop string the prompts contain (only the completion is searched)."""
    prompts, steps = ["The quick brown fox", "Once upon a time, the fox"], 6
    args = dict(model=NAME, prompt=prompts, max_tokens=steps, n=2, logprobs=1, stop=["fox"], **GREEDY)
    plain = client.completions.create(**args).choices
    echoed = client.completions.create(echo=True, **args).choices
    streamed: dict[int, list[str]] = {}
    for chunk in client.completions.create(echo=True, stream=True, **args):
        for choice in chunk.choices:
            streamed.setdefault(choice.index, []).append(choice.text)
    for without, choice in zip(plain, echoed, strict=True):
        prompt = prompts[choice.index // 2]
        assert choice.text == prompt + without.text and choice.finish_reason == without.finish_reason
        assert streamed[choice.index][0].startswith(prompt) and "".join(streamed[choice.index]) == choice.text
        tail = len(without.logprobs.tokens)
        assert choice.logprobs.tokens[-tail:] == without.logprobs.tokens
        assert choice.logprobs.token_logprobs[-tail:] == pytest.approx(without.logprobs.token_logprobs, abs=1e-4)
        assert len(choice.logprobs.tokens) == _tokenize(client, {"prompt": prompt}) + tail


def test_echo_of_segments_and_of_token_ids(client) -> None:
    """Segments come back joined (scored by a full recompute, nothing cached); token ids decoded."""
    segments = ["Answer briefly. ", "The fox lives in the forest. ", "Where is the fox?"]
    for _ in range(2):  # the second time the segments are in the pool, and still not used
        whole = client.completions.create(model=NAME, prompt=None, max_tokens=0, echo=True, logprobs=0,
                                          extra_body={"segments": segments})
    choice = whole.choices[0]
    assert choice.text == "".join(segments) and choice.logprobs.token_logprobs[0] is None
    assert len(choice.logprobs.tokens) == whole.usage.prompt_tokens and whole.usage.prompt_tokens_details.cached_tokens == 0
    ids, _ = _token_ids_and_count(client, {"prompt": "The fox lives in the forest."})
    by_ids = client.completions.create(model=NAME, prompt=ids, max_tokens=2, echo=True, **GREEDY).choices[0]
    assert by_ids.text.startswith("The fox lives in the forest.") and by_ids.logprobs is None


def test_bad_request_raises_the_clients_typed_error(client) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        tool = {"type": "function", "function": {"name": "f"}}
        client.chat.completions.create(model=NAME, messages=CHAT, tools=[tool, tool])  # duplicate names
    assert caught.value.body["param"] == "tools"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x", max_tokens=1)


def test_sigterm_exits_zero(server, client) -> None:
    process, _ = server
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0
