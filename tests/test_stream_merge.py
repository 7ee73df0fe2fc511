"""The server's merge of a request's n streams when its client goes away: nothing pending is destroyed
(asyncio reports "Task was destroyed but it is pending!"), and nothing is left waiting afterwards."""

import asyncio
import gc

from jaxcb.server import streaming


def asyncio_reports(scenario) -> list[str]:
    """What asyncio's exception handler reports while `scenario()` runs and its garbage is collected."""
    reports = []

    async def main():
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: reports.append(context["message"]))
        await scenario()
        for _ in range(5):
            gc.collect()
            await asyncio.sleep(0.01)

    asyncio.run(main())
    gc.collect()
    return reports


class _Stream:
    """A stream whose first output comes at once and whose second never does (a long generation)."""

    def __init__(self):
        self.sent = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.sent:
            self.sent = True
            return "first"
        await asyncio.Event().wait()


def test_a_merge_abandoned_by_a_disconnected_client_ends_its_pumps_without_destroying_them():
    async def disconnect():
        async def client():
            async for _ in streaming.merged([_Stream() for _ in range(4)]):
                pass

        task = asyncio.ensure_future(client())
        await asyncio.sleep(0.05)
        task.cancel()  # the client disconnects: its response task is cancelled

    reports = asyncio_reports(disconnect)
    assert not [r for r in reports if "destroyed but it is pending" in r], reports
    assert not streaming._ENDING


class _AbortingStream(_Stream):
    """A stream that ends with an error when its request is aborted (as a closed engine stream does)."""

    def close(self):
        pass

    async def __anext__(self):
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            raise RuntimeError("aborted") from None


class _GoneClient:
    async def is_disconnected(self):
        return True


def test_a_whole_response_whose_client_went_away_leaves_no_error_unread():
    # The gather of its streams ended with the streams' error after the cancel; nobody read it, so
    # asyncio logged "_GatheringFuture exception was never retrieved" for every such client.
    async def gone():
        state = type("State", (), {"num_in_flight": 0})()
        try:
            await streaming.collect_final_outputs(state, _GoneClient(), [_AbortingStream() for _ in range(3)])
        except streaming.APIError as e:
            assert e.status == 499

    reports = asyncio_reports(gone)
    assert not [r for r in reports if "never retrieved" in r], reports
