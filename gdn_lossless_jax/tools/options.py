"""Option types for the command line: argparse turns their ``ArgumentTypeError`` into
``argument --x: <message>``."""

from __future__ import annotations

import argparse
import math

__all__ = ["positive_int", "non_negative_int", "positive_gib", "tensor_sizes", "tree_branching", "model_name"]


def _int_option(minimum: int, what: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be {what}, got {value}")
        return value

    parse.__doc__ = f"An integer >= {minimum}."
    return parse


positive_int = _int_option(1, "a positive integer")


non_negative_int = _int_option(0, "a non-negative integer")


def positive_gib(text: str) -> float:
    """A finite number of GiB > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number of GiB, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of GiB, got {text}")
    return value


def tensor_sizes(text: str) -> tuple[int, ...]:
    """Tensor sizes: N (the powers of two up to N, and N) or a list like ``1,2,4,8``."""
    from .memory import tp_sizes

    try:
        return tp_sizes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def tree_branching(text: str) -> tuple[int, ...]:
    """A draft tree's branching per depth, ``2,2,2``."""
    from .memory import tree_shape

    try:
        return tree_shape(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def model_name(text: str) -> str:
    """A name :func:`gdn_lossless_jax.get_geometry` knows (aliases included)."""
    from ..config import get_geometry

    try:
        get_geometry(text)
    except KeyError as e:
        raise argparse.ArgumentTypeError(e.args[0]) from None
    return text
