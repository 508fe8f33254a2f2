"""Artifact routes: a worker uploads a blob for its running attempt; clients list and
download them. Bodies are streamed in chunks both ways: a large artifact is never held
whole in the server's memory."""

from __future__ import annotations

import hashlib
import logging
import re
from functools import partial
from urllib.parse import quote

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import iterate_in_threadpool, run_in_threadpool

from orbit.core.errors import DATABASE_FULL, Code, OrbitError
from orbit.core.model import SECOND, Artifact
from orbit.core.validate import MAX_ARTIFACT_TTL_S
from orbit.protocol.messages import ArtifactPage, ArtifactView
from orbit.server.auth import require
from orbit.server.errors import DATABASE_RETRY_AFTER_S, ApiError
from orbit.server.routes import (
    LISTING,
    Limit,
    artifact_cursor,
    declared_length,
    declares_over,
    encode_cursor,
)
from orbit.server.views import artifact_view
from orbit.store import Store

log = logging.getLogger("orbit.server")
router = APIRouter(prefix="/v1")
CHUNK = 256 * 1024
_COUNTER = re.compile(r"^(0|[1-9][0-9]{0,18})\Z")
#: a digest in either case: what sha256sum gives, and what certutil or .NET's
#: Convert.ToHexString give (upper-case); compared lower-cased
_SHA = re.compile(r"^[0-9a-fA-F]{64}\Z")
_SECONDS = re.compile(r"^[0-9]{1,9}\Z")
#: How many chunks an upload writes between two looks at the free space of a SQLite
#: database's disk (``Store.artifact_disk_room``, one ``statvfs``): 2 MiB.
ROOM_EVERY = 8
#: the longest X-Orbit-TTL, in seconds: the store keeps an artifact at most the longest
#: duration Orbit accepts anywhere (the worker's ``Context.upload`` checks the same bound)
MAX_TTL_S = MAX_ARTIFACT_TTL_S


def attachment(name: str) -> str:
    """A download's Content-Disposition (RFC 6266): ``filename`` holds the name in
    printable ASCII with a quote, a backslash or any other character replaced by ``_``,
    so that no name can end the quoted string or the header; ``filename*`` (RFC 5987)
    holds the exact name, percent-encoded UTF-8, when it differs."""
    plain = "".join(c if " " <= c <= "~" and c not in '"\\' else "_" for c in name)
    exact = quote(name, safe="")
    if exact == plain:
        return f'attachment; filename="{plain}"'
    return f"attachment; filename=\"{plain}\"; filename*=UTF-8''{exact}"


def _header_counter(request: Request, name: str) -> int:
    value = request.headers.get(name)
    if value is None or not _COUNTER.match(value) or int(value) > 2**63 - 1:
        raise ApiError(400, "INVALID_ARGUMENT", f"header {name} must be a counter (a decimal)")
    return int(value)


@router.put(
    "/attempts/{attempt_id}/artifacts/{name}",
    dependencies=[Depends(require("worker"))],
    status_code=201,
    response_model=ArtifactView,
    responses={
        200: {
            "model": ArtifactView,
            "description": "a repeat: the attempt's artifact of this name, committed "
            "already with the digest X-Orbit-Sha256 declares (and the body has); nothing "
            "was written",
        }
    },
)
async def artifact_upload(request: Request, attempt_id: str, name: str) -> JSONResponse:
    """Headers: X-Orbit-Session, X-Orbit-Epoch, X-Orbit-Fence (the attempt's), Content-Type,
    optional X-Orbit-Sha256 (checked) and X-Orbit-TTL (seconds). 201 for a new artifact;
    200 for a repeat of the upload that committed it (same name, same X-Orbit-Sha256:
    one whose reply was lost, sent again), answered with that artifact."""
    try:
        artifact, repeat = await _receive(request, attempt_id, name)
    except OrbitError as exc:
        # A refused upload is a refused worker report: counted as the gateway counts one.
        request.app.state.metrics.report_refused(exc)
        raise
    status = 200 if repeat else 201
    return JSONResponse(artifact_view(artifact).model_dump(mode="json"), status_code=status)


async def _receive(request: Request, attempt_id: str, name: str) -> tuple[Artifact, bool]:
    """Stream the body into a fenced upload and commit it; abort it on any failure.
    Returns the artifact, and whether the upload was a repeat of the one that stored it."""
    store: Store = request.app.state.store
    session_id = request.headers.get("x-orbit-session", "")
    if not 0 < len(session_id) <= 64:
        raise ApiError(400, "INVALID_ARGUMENT", "header X-Orbit-Session is required")
    epoch = _header_counter(request, "x-orbit-epoch")
    fence = _header_counter(request, "x-orbit-fence")
    expected = request.headers.get("x-orbit-sha256")
    if expected is not None:
        if not _SHA.match(expected):
            raise ApiError(400, "INVALID_ARGUMENT", "X-Orbit-Sha256 must be 64 hex digits")
        expected = expected.lower()  # as hexdigest() writes the body's
    ttl = request.headers.get("x-orbit-ttl")
    ttl_us = None
    if ttl is not None:
        # ASCII digits only: str.isdigit also admits '²', which int() refuses (a 500)
        if not _SECONDS.match(ttl) or not 1 <= int(ttl) <= MAX_TTL_S:
            raise ApiError(
                400,
                "INVALID_ARGUMENT",
                f"X-Orbit-TTL must be whole seconds, from 1 to {MAX_TTL_S}",
                "X-Orbit-TTL",
            )
        ttl_us = int(ttl) * SECOND
    limit = store.config.max_artifact_bytes
    if declares_over(request.headers.get("content-length"), limit):
        raise _too_large(limit)
    content_type = request.headers.get("content-type", "application/octet-stream")
    declared = declared_length(request.headers.get("content-length"), limit)
    # Before anything is written: the whole declared body, else the first stretch.
    await _check_room(store, ROOM_EVERY * CHUNK if declared is None else declared, 0)
    begun = await run_in_threadpool(
        partial(
            store.artifact_begin,
            name=name,
            content_type=content_type,
            ttl_us=ttl_us,
            sha256=expected,
        ),
        session_id,
        epoch,
        attempt_id,
        fence,
    )
    if isinstance(begun, Artifact):
        await _repeated(request, begun, limit)
        return begun, True
    artifact_id = begun
    digest, size, seq, buffer = hashlib.sha256(), 0, 0, bytearray()
    try:
        async for piece in request.stream():
            size += len(piece)
            if size > limit:
                raise _too_large(limit)
            digest.update(piece)
            buffer += piece
            while len(buffer) >= CHUNK:
                if seq and seq % ROOM_EVERY == 0:
                    # What is left of a declared body, else the stretch to the next look
                    ahead = ROOM_EVERY * CHUNK if declared is None else declared - seq * CHUNK
                    await _check_room(store, max(ahead, CHUNK), seq * CHUNK)
                await run_in_threadpool(
                    store.artifact_write, artifact_id, seq, bytes(buffer[:CHUNK])
                )
                del buffer[:CHUNK]
                seq += 1
        if buffer or seq == 0:
            await run_in_threadpool(store.artifact_write, artifact_id, seq, bytes(buffer))
        sha = digest.hexdigest()
        if expected is not None and expected != sha:
            raise OrbitError(Code.DIGEST_MISMATCH, f"the body's sha256 is {sha}, not {expected}")
        artifact = await run_in_threadpool(
            partial(store.artifact_commit, size=size, sha256=sha),
            session_id,
            epoch,
            attempt_id,
            fence,
            artifact_id,
        )
    except BaseException as exc:
        try:
            await run_in_threadpool(store.artifact_abort, artifact_id)
            dropped = True
        except Exception as failed:  # the database went down too: the upload's error stands
            dropped = False
            # Its type only: a driver's message may quote the database's address.
            log.warning(
                "could not drop the failed upload %s (%s): the reaper drops it once its "
                "attempt has ended",
                artifact_id,
                type(failed).__name__,
            )
        if isinstance(exc, _NoRoom):
            raise exc.refusal(dropped) from None
        raise
    return artifact, False


class _NoRoom(Exception):
    """The disk of a SQLite database has too little free space for the rest of an upload
    (``_check_room``). Answered once the upload is dropped, so that the answer can say
    whether it was."""

    def __init__(self, written: int) -> None:
        super().__init__("too little free space on the database's disk")
        self.written = written

    def refusal(self, dropped: bool = True) -> ApiError:
        """503 ``DATABASE_FULL``, as a write that found the disk full, with its
        ``Retry-After``: the upload may fit once the reaper has deleted expired
        artifacts or an operator has made room. Not 507 Insufficient Storage (WebDAV's):
        the client and the worker SDK already take ``DATABASE_FULL`` for the database's
        condition (``DATABASE_CODES``), and every other write on a full disk answers it;
        a 507 would be one more status for each of them to learn."""
        why = (
            "the database's disk has too little free space for this upload (the server "
            "keeps some free for its other writes)"
        )
        if not self.written:
            what = "nothing was written"
        elif dropped:
            what = f"the upload was stopped and the {self.written} bytes it had written dropped"
        else:
            what = (
                f"the upload was stopped; the {self.written} bytes it had written could not "
                "be dropped now, and the reaper drops them once its attempt has ended"
            )
        return ApiError(
            503,
            DATABASE_FULL,
            f"{why}; {what}",
            headers={"Retry-After": str(DATABASE_RETRY_AFTER_S)},
        )


async def _check_room(store: Store, need: int, written: int) -> None:
    """Refuse (``_NoRoom``) to write ``need`` more bytes of an upload that has written
    ``written`` where that would leave less free than ``StoreConfig.
    artifact_disk_reserve_bytes`` on a SQLite database's disk. An upload that filled it
    wedged the node: every later write failed (submits, finishes, the reaper's passes,
    the delete of the upload itself, whose chunks then held the space). A no-op on
    PostgreSQL, whose server's disk is not the node's to see."""
    room = await run_in_threadpool(store.artifact_disk_room)
    if room is None:
        return
    free, reserve = room
    if free - need >= reserve:
        return
    log.warning(
        "refused an upload: %d bytes more would leave %d of the %d bytes free on the "
        "database's disk, under the %d kept for other writes",
        need,
        max(free - need, 0),
        free,
        reserve,
    )
    if written:
        raise _NoRoom(written)
    raise _NoRoom(0).refusal()


async def _repeated(request: Request, artifact: Artifact, limit: int) -> None:
    """Read a repeat's body whole and check that it is the bytes its X-Orbit-Sha256
    declared (the store found the artifact by that digest); write nothing. Read before
    the answer: one sent while the client was still sending broke its send."""
    digest, size = hashlib.sha256(), 0
    async for piece in request.stream():
        size += len(piece)
        if size > limit:
            raise _too_large(limit)
        digest.update(piece)
    sha = digest.hexdigest()
    if sha != artifact.sha256:
        raise OrbitError(Code.DIGEST_MISMATCH, f"the body's sha256 is {sha}, not {artifact.sha256}")


def _too_large(limit: int) -> ApiError:
    return ApiError(413, str(Code.ARTIFACT_TOO_LARGE), f"artifacts are at most {limit} bytes")


@router.get(
    "/tasks/{task_id}/artifacts",
    dependencies=[Depends(require("submit")), *LISTING],
    response_model=ArtifactPage,
)
async def artifact_list(
    request: Request, task_id: str, limit: Limit = 100, cursor: str | None = None
) -> JSONResponse:
    """A page of the task's artifacts in the order their uploads were committed, the
    cursor standing for the last one's place in it (``ready_seq``): a reader that asks
    again from its last cursor gets the artifacts committed since, none passed over (the
    order of ids, when each upload began, let a long upload land behind the cursor). A
    cursor from before that order (an artifact id) that names no ready artifact of the
    task is INVALID_CURSOR."""
    store: Store = request.app.state.store
    after_seq, after_id = artifact_cursor(cursor)
    await run_in_threadpool(store.task_get, task_id)  # 404 for an unknown task
    try:
        items = await run_in_threadpool(
            partial(
                store.artifact_list, task_id, after_seq=after_seq, after_id=after_id, limit=limit
            )
        )
    except OrbitError as exc:
        # all that is left to refuse: an id naming none, or a place past every place
        # ever drawn (its empty page would read as "nothing new yet" for ever)
        if exc.code is not Code.INVALID_ARGUMENT:
            raise
        raise ApiError(
            400, "INVALID_CURSOR", "the cursor is not one this server issued", "cursor"
        ) from None
    nxt = encode_cursor(str(items[-1].ready_seq)) if len(items) == limit else None
    page = ArtifactPage(items=[artifact_view(a) for a in items], next_cursor=nxt)
    return JSONResponse(page.model_dump(mode="json"))


@router.get(
    "/artifacts/{artifact_id}",
    dependencies=[Depends(require("submit"))],
    response_model=ArtifactView,
)
async def artifact_get(request: Request, artifact_id: str) -> JSONResponse:
    artifact = await run_in_threadpool(request.app.state.store.artifact_get, artifact_id)
    return JSONResponse(artifact_view(artifact).model_dump(mode="json"))


@router.get(
    "/artifacts/{artifact_id}/content",
    dependencies=[Depends(require("submit"))],
    response_class=StreamingResponse,
    responses={200: {"description": "the artifact's bytes", "content": {"*/*": {}}}},
)
async def artifact_content(request: Request, artifact_id: str) -> StreamingResponse:
    store: Store = request.app.state.store
    artifact = await run_in_threadpool(store.artifact_get, artifact_id)
    return StreamingResponse(
        iterate_in_threadpool(store.artifact_chunks(artifact_id)),
        headers=_content_headers(artifact),
    )


# Left out of openapi.json: it answers the GET's headers, which the GET's entry there
# describes; docs/protocol.md names it beside the GET.
@router.head(
    "/artifacts/{artifact_id}/content",
    dependencies=[Depends(require("submit"))],
    include_in_schema=False,
)
async def artifact_content_head(request: Request, artifact_id: str) -> Response:
    """The headers a GET of the content answers (its length, digest, type, name), no
    body: a client learns the size or checks the digest without the bytes. It was 405."""
    artifact = await run_in_threadpool(request.app.state.store.artifact_get, artifact_id)
    return Response(headers=_content_headers(artifact))


def _content_headers(artifact: Artifact) -> dict[str, str]:
    """A download's headers. ``Accept-Ranges: none``: a ``Range`` is not honoured, the
    whole body is sent (200), and a client must not take a 200 for its range."""
    return {
        "Accept-Ranges": "none",
        "Content-Length": str(artifact.size),
        "X-Orbit-Sha256": artifact.sha256 or "",
        "Content-Disposition": attachment(artifact.name),
        # The Content-Type is the uploader's word: a browser must not second-guess it
        # (an uploaded page sniffed as text/html would run as this origin's page). Set
        # as a header, not as media_type, to which Starlette adds "; charset=utf-8" for
        # text/*: a Shift_JIS text/plain file was labelled UTF-8.
        "Content-Type": artifact.content_type,
        "X-Content-Type-Options": "nosniff",
    }
