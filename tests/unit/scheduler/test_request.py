"""Request state and stop conditions."""

from services.common.proto.meshserve.v1 import sampling_pb2
from services.scheduler.block_hash import hash_request_blocks
from services.scheduler.request import Request, RequestStatus, check_stop

EOS = 2


def make(max_tokens: int = 10, **sampling: object) -> Request:
    params = sampling_pb2.SamplingParams(**sampling)  # type: ignore[arg-type]
    return Request("r", [5, 6, 7], params, eos_token_ids=[EOS], max_tokens=max_tokens)


def append(request: Request, token: int) -> RequestStatus | None:
    request.output_token_ids.append(token)
    return check_stop(request)


def test_eos_stops() -> None:
    r = make()
    assert append(r, 9) is None
    assert append(r, EOS) is RequestStatus.FINISHED_STOPPED
    assert r.stop_token_id is None


def test_ignore_eos_keeps_going() -> None:
    r = make(ignore_eos=True)
    assert append(r, EOS) is None


def test_stop_token_ids_record_the_match() -> None:
    r = make(stop_token_ids=[42, 43])
    assert append(r, 41) is None
    assert append(r, 43) is RequestStatus.FINISHED_STOPPED
    assert r.stop_token_id == 43


def test_max_tokens_is_length() -> None:
    r = make(max_tokens=2)
    assert append(r, 9) is None
    assert append(r, 9) is RequestStatus.FINISHED_LENGTH


def test_status_helpers() -> None:
    assert RequestStatus.FINISHED_ABORTED.is_finished()
    assert not RequestStatus.PREEMPTED.is_finished()
    assert RequestStatus.FINISHED_LENGTH.finish_reason() == sampling_pb2.FINISH_REASON_LENGTH
    assert RequestStatus.RUNNING.finish_reason() == sampling_pb2.FINISH_REASON_UNSPECIFIED


def test_block_hashes_extend_with_outputs() -> None:
    r = Request("r", list(range(6)), sampling_pb2.SamplingParams(), [EOS], max_tokens=10)
    assert r.get_block_hashes(4) == hash_request_blocks(list(range(6)), 4)
    r.output_token_ids += [100, 101, 102]
    assert r.all_token_ids == [*range(6), 100, 101, 102]
    assert r.num_tokens == 9
    assert r.get_block_hashes(4) == hash_request_blocks(r.all_token_ids, 4)
    assert len(r.get_block_hashes(4)) == 2


def test_min_tokens_holds_off_eos_and_stop_ids_but_not_the_length() -> None:
    req = make(max_tokens=3, min_tokens=2, stop_token_ids=[7])
    assert append(req, EOS) is None and append(req, 7) is None  # the first two may not stop
    assert append(req, EOS) is RequestStatus.FINISHED_STOPPED
    capped = make(max_tokens=2, min_tokens=2)
    assert append(capped, 5) is None and append(capped, EOS) is RequestStatus.FINISHED_LENGTH
