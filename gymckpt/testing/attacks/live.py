"""The attack table's live rows: attacks on a running system, each carried out by one test.

A static row (:mod:`gymckpt.testing.attacks.store`) damages a checkpoint at rest and runs on
every backend. A live row needs something running: a server, a client, a race between a
check and a use, a prune under way. Each names the promise it checks and the test
(``path::name``, in ``make test``) that carries the attack out and asserts the promise;
``tests/test_attack_table.py`` checks every named test exists.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LIVE_ATTACKS", "LiveAttack"]


@dataclass(frozen=True)
class LiveAttack:
    """One live row: the promise, and the test that attacks it."""

    promise: str
    #: ``tests/<path>.py::<test function>``
    test: str


def _rows(promise: str, tests: dict[str, str]) -> dict[str, LiveAttack]:
    return {name: LiveAttack(promise, test) for name, test in tests.items()}


_RESTORE = "tests/control/test_restore_published.py"
_DIRFD = "tests/store/test_local_dirfd.py"
_AUTH = "tests/control/test_auth_before_body.py"
_SLOW = "tests/servers/test_slow_clients.py"
_REPLIES = "tests/control/test_bounded_replies.py"

LIVE_ATTACKS: dict[str, LiveAttack] = {
    **_rows(
        "a restore takes exactly what was published: another manifest is 422 and nothing is installed",
        {
            "participant_directory_from_another_checkpoint": f"{_RESTORE}::"
            "test_a_participant_directory_from_another_checkpoint_is_refused_and_nothing_installed",
            "restore_body_names_another_digest": f"{_RESTORE}::test_a_digest_the_body_names_must_be_the_manifests",
            "restore_body_names_another_checkpoint_id": f"{_RESTORE}::"
            "test_a_source_checkpoint_id_the_body_names_must_be_the_manifests_and_the_indexs",
            "participant_the_index_does_not_list": f"{_RESTORE}::test_a_participant_the_index_does_not_list_is_refused",
            "index_removed_after_the_controller_read_it": f"{_RESTORE}::"
            "test_the_coordinator_sends_each_server_its_published_digest",
            "damaged_checkpoint_through_the_coordinator": f"{_RESTORE}::"
            "test_the_coordinator_refuses_a_damaged_checkpoint_before_calling_any_server",
            "unpublished_directory_through_the_coordinator": f"{_RESTORE}::"
            "test_the_coordinator_restores_only_published_checkpoints",
            "tampered_checkpoint_on_a_server_of_several_workers": f"{_RESTORE}::"
            "test_a_server_of_several_workers_refuses_on_its_coordinator",
        },
    ),
    **_rows(
        "a path checked once is the path used: a directory swapped for a symlink after the check leads nowhere",
        {
            "root_swapped_after_the_store_was_opened": f"{_DIRFD}::"
            "test_a_root_swapped_after_the_store_was_opened_is_refused_and_nothing_lands_outside",
            "directory_swapped_mid_commit": f"{_DIRFD}::"
            "test_a_directory_swapped_while_the_records_are_written_is_refused_and_nothing_lands_outside",
            "allowed_root_swapped_between_check_and_open": f"{_DIRFD}::"
            "test_the_allowed_roots_check_and_the_store_share_one_resolution",
            "directory_swapped_between_manifest_and_records": f"{_DIRFD}::"
            "test_a_directory_swapped_between_manifest_and_records_is_refused_and_nothing_outside_is_read",
            "root_swapped_before_a_restore": f"{_DIRFD}::test_a_root_swapped_before_a_restore_is_refused",
            "mount_without_link": f"{_DIRFD}::test_a_filesystem_without_link_is_refused_before_the_first_records_byte",
        },
    ),
    **_rows(
        "memory follows the records, not the bytes on disk: verify holds one checkpoint's manifests at a time",
        {
            "many_checkpoints_under_one_root": "tests/store/test_verify_edges.py::"
            "test_verify_holds_at_most_one_checkpoints_manifests",
        },
    ),
    **_rows(
        "every route to a control endpoint refuses an unauthenticated call before reading its body",
        {
            "control_body_behind_the_rollout_prefix": f"{_AUTH}::"
            "test_every_server_refuses_an_unauthenticated_control_body_before_reading_it_with_or_without_the_prefix",
            "control_body_through_a_path_rewrite": f"{_AUTH}::"
            "test_the_route_itself_refuses_before_the_body_whatever_rewrote_the_path",
            "control_body_forwarded_between_workers": f"{_AUTH}::"
            "test_a_worker_never_forwards_an_unauthenticated_control_body_to_another_worker",
            "unknown_control_path_behind_the_prefix": f"{_AUTH}::"
            "test_a_control_path_no_route_serves_is_401_too_behind_the_prefix",
            "huge_announced_body_on_a_real_server": f"{_AUTH}::"
            "test_a_real_server_answers_401_before_the_client_sent_the_body",
        },
    ),
    **_rows(
        "a slow client holds nothing for long: heads and bodies have deadlines, control calls get through",
        {
            "half_sent_head": f"{_SLOW}::test_a_half_sent_head_gets_408_and_is_closed",
            "silent_connection": f"{_SLOW}::test_a_connection_that_sends_nothing_is_closed_without_a_reply_after_the_keep_alive",
            "head_trickled_a_byte_at_a_time": f"{_SLOW}::test_a_head_trickled_a_byte_at_a_time_is_cut",
            "incomplete_heads_past_the_descriptors": f"{_SLOW}::"
            "test_control_calls_get_through_while_slow_heads_exceed_the_descriptors",
            "body_below_the_minimum_rate": f"{_SLOW}::test_a_parked_app_keeps_its_clients_while_a_slow_body_is_cut",
            "body_trickled_after_an_early_401": f"{_SLOW}::"
            "test_a_body_the_server_drains_after_an_early_401_is_bounded_too",
        },
    ),
    **_rows(
        "every reply a client reads is bounded; a breach fails that server only",
        {
            "endless_status_reply": f"{_REPLIES}::"
            "test_discover_reports_a_server_whose_status_never_ends_and_finds_the_others",
            "endless_or_declared_huge_data_reply": f"{_REPLIES}::test_a_downstream_reply_that_never_ends_fails_that_call_only",
        },
    ),
    **_rows(
        "the operator sees what is there, and only text: no crash, no raw control byte, pruning is not damage",
        {
            "file_name_not_utf8": "tests/test_cli_edges.py::test_verify_json_of_names_that_are_not_utf8",
            "integer_extra_beyond_64_bits": "tests/test_cli_edges.py::test_inspect_json_writes_what_the_store_accepts",
            "terminal_control_sequences_in_names": "tests/test_cli_edges.py::"
            "test_no_control_byte_from_a_file_name_reaches_a_real_process_output",
            "checkpoint_vanished_mid_check": "tests/store/test_verify_edges.py::"
            "test_a_checkpoint_deleted_while_checked_is_one_warning",
            "file_lost_mid_check_is_still_damage": "tests/store/test_verify_edges.py::"
            "test_a_published_checkpoint_that_loses_a_file_while_checked_is_damaged",
            "verify_while_collect_prunes": "tests/collect/test_prune.py::"
            "test_verify_of_the_root_while_collect_prunes_warns_and_exits_0",
            "verify_while_collect_prunes_on_s3": "tests/s3/test_s3_prune.py::test_verify_of_the_root_while_collect_prunes_warns",
            "s3_keys_no_path_names": "tests/s3/test_s3_odd_keys.py::test_verify_reports_every_key_no_path_names",
        },
    ),
}
