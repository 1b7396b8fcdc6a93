"""The emulated cluster and the real operator of tests/operator, for the live dashboards
test (pytest reads fixtures from a conftest beside the test, so they are imported here)."""

from tests.operator.conftest import (  # noqa: F401
    cluster,
    emulated_testbed,
    kubelet,
    operator,
    rank0,
)
