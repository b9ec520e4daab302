"""`hypic demo`: the bundled model answers its question cold and warm, and the warm request reads the cache."""
from __future__ import annotations

import ast
import re

from hypic.cli import main
from hypic.data import eval_prompts


def test_demo_answers_cold_then_warm_from_the_cache(capsys) -> None:
    assert main(["demo", "--device", "cpu"]) == 0
    lines = capsys.readouterr().out.splitlines()
    runs = [re.search(r"cached_tokens +(\d+) of (\d+): (.*)$", line) for line in lines[1:]]
    assert len(runs) == 2 and all(runs)
    (cold, prompt_tokens, cold_text), (warm, warm_tokens, warm_text) = (run.groups() for run in runs)
    answer = eval_prompts(1)[0].answer
    assert [ast.literal_eval(text).rpartition("Answer: ")[2] for text in (cold_text, warm_text)] == [answer, answer]
    assert int(cold) == 0 and prompt_tokens == warm_tokens and 0.5 * int(prompt_tokens) < int(warm) < int(prompt_tokens)
