"""The CRD's handoff policy names and the readers' translation table must not drift."""

from __future__ import annotations

from typing import get_args

import pytest

from pdd.common.config_document import HANDOFF_POLICIES
from pdd.operator.spec import Handoff

pytestmark = pytest.mark.unit


def test_every_crd_handoff_policy_has_a_flag_value() -> None:
    crd_names = set(get_args(Handoff.model_fields["policy"].annotation))
    assert crd_names == set(HANDOFF_POLICIES)
    assert set(HANDOFF_POLICIES.values()) == {"auto", "one-shot", "catch-up"}
