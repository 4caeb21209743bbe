"""Parsing what users type for POP's settings: one parser for the command line, the page and the HTTP API."""
from __future__ import annotations

import argparse

import pytest

from pop_vlm import PopConfig
from pop_vlm.cli import parse_prune_layers as cli_prune_layers
from pop_vlm.config import parse_prune_layers


@pytest.mark.parametrize("value, expected", [(None, 1 / 3), ("", 1 / 3), ("  ", 1 / 3), ("auto", "auto"), (" AUTO ", "auto"),
                                             ("3", 3), (3, 3), (3.0, 3), ("0.25", 0.25), (0.25, 0.25), ("2.0", 2)])
def test_prune_layers_values(value, expected):
    assert parse_prune_layers(value) == expected


@pytest.mark.parametrize("value", ["three", "1/3", True, [2]])
def test_prune_layers_refuses_what_it_cannot_read(value):
    with pytest.raises(ValueError, match="prune_layers"):
        parse_prune_layers(value)


def test_command_line_reports_a_bad_value_as_a_usage_error():
    assert cli_prune_layers("0.5") == 0.5
    with pytest.raises(argparse.ArgumentTypeError, match="prune_layers"):
        cli_prune_layers("many")


def test_a_parsed_value_resolves_against_the_layer_count():
    assert PopConfig(prune_layers=parse_prune_layers("0.25")).num_pruned(28) == 7
    assert PopConfig(prune_layers=parse_prune_layers("")).num_pruned(18) == 6
