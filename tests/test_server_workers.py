"""`python -m hypic.serve --workers N`: the HTTP front over a cluster of CPU engine processes."""
from __future__ import annotations

import pytest

from hypic.dist.client import DistributedEngineClient
import argparse

from hypic.serve.args import add_serve_arguments, engine_config, server_settings
from hypic.engine.client import InProcessEngineClient
from hypic.serve.server import engine_client


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser


def settings_for(*argv: str):
    args = build_parser().parse_args(["--device", "cpu", *argv])
    return engine_config(args), server_settings(args)


def test_one_worker_serves_in_process_and_several_start_a_cluster():
    config, settings = settings_for()
    assert isinstance(engine_client(config, settings), InProcessEngineClient)
    config, settings = settings_for("--workers", "3", "--transport", "tcp")
    assert (settings.workers, settings.transport) == (3, "tcp")
    assert isinstance(engine_client(config, settings), DistributedEngineClient)  # nothing starts before start()


@pytest.mark.parametrize("bad", [["--workers", "0"], ["--gpus", "1,1"], ["--gpus", "a"], ["--transport", "ib"]])
def test_bad_parallel_options_are_refused(bad):
    with pytest.raises(SystemExit):
        build_parser().parse_args(bad)
