"""A failure in one request's own work ends that request alone, never its batch mates.

What a step does per request after the forward pass (the grammar's mask and advance,
the logits processors, the sampler, the logprobs) runs batched over every request that
samples. A stage that raises is one request's doing far more often than the step's (a
grammar llguidance gives up on, a parameter mix nothing anticipated), so the batch is
run again row by row (``per_row``) and only the rows that raise again fail, each with
its own error; the others get exactly the tokens the batched run would have given them,
since every stage treats each row on its own (``sampling``). Each stage names itself in
the error and says whose fault it is (``stage``): a grammar's failure is the client's
input (``GRAMMAR_ERROR_TYPE``, a 400 through the router), any other the request's own
(``REQUEST_FAILED_ERROR_TYPE``). Only the shared forward pass can fail a whole step
(``Engine.fail_scheduled``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TypeVar

import torch

from pdd.common.grammar import GRAMMAR_ERROR_TYPE
from pdd.common.wire import REQUEST_FAILED_ERROR_TYPE
from pdd.worker.engine.grammar import GrammarRequestError
from pdd.worker.engine.request import RequestFailedError

log = logging.getLogger(__name__)

R = TypeVar("R")
T = TypeVar("T")

#: The batched work: one result per row of the logits (it raises where one fails).
Batched = Callable[[torch.Tensor, list[R]], Sequence[T]]


@contextmanager
def stage(what: str, error_type: str) -> Iterator[None]:
    """Run one stage of a request's work: whatever it raises becomes a
    ``RequestFailedError`` that names the stage (one already raised as such passes)."""
    try:
        yield
    except RequestFailedError:
        raise
    except Exception as exc:
        raise RequestFailedError(f"{what} failed: {exc}", error_type) from exc


def fault_of(exc: BaseException | None) -> str | None:
    """The ``TokenEvent.error_type`` of ``exc`` where it is a request's own failure (its
    work in a step, its grammar that would not compile at admission), else None (the
    instance's failure, or none at all): what a role passes on to the router."""
    if isinstance(exc, RequestFailedError):
        return exc.error_type
    if isinstance(exc, GrammarRequestError):
        return GRAMMAR_ERROR_TYPE
    return None


def per_row(
    run: Batched[R, T], logits: torch.Tensor, rows: Sequence[R]
) -> list[T | RequestFailedError]:
    """``run`` over the whole batch; where that raises, over each row alone, a row that
    raises then getting its own error as its result."""
    try:
        return list(run(logits, list(rows)))
    except Exception as exc:
        log.warning("a batch of %d requests failed to sample (%s); sampling them one by one",
                    len(rows), exc)  # fmt: skip
    return [_one(run, logits[i : i + 1], row) for i, row in enumerate(rows)]


def _one(run: Batched[R, T], logits: torch.Tensor, row: R) -> T | RequestFailedError:
    try:
        [result] = run(logits, [row])
    except RequestFailedError as exc:
        return exc
    except Exception as exc:  # outside any stage: still this row's alone
        return RequestFailedError(f"sampling failed: {exc!r}", REQUEST_FAILED_ERROR_TYPE)
    return result
