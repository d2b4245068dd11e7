"""The shared equivalence suite now ships in the package (gdn_lossless_jax.testing.equivalence);
this module keeps the name the tests import it by."""

from gdn_lossless_jax.testing.equivalence import (  # noqa: F401
    Case,
    check_commit,
    check_controls,
    check_outputs,
    check_replay_every_step,
    commit_accepted_first,
    commit_both,
    layer_tapes,
    make_case,
    control_replays,
    request_writes,
    written_slots,
)
