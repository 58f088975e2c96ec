"""Paged answers gathered under a total bound (endless data).

gRPC's message cap bounds one page, not how many pages a server sends: a server or mirror that
keeps answering "there is more" would fill a device's memory. Every paging loop of the client
goes through :func:`gather_pages`, which checks each page against a :class:`PagingBound` (items
and their wire bytes, in all) as it arrives, before any of it is kept, and refuses a page that
brings nothing yet asks for another. Bytes are counted as the pages' wire bytes: an item read
from a page keeps the whole page in memory, so what the server sent is what the client holds."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from google.protobuf.message import Message

from fctkit.errors import FctkitError

Page = TypeVar("Page", bound=Message)  # one answer of a paged call
Item = TypeVar("Item")  # what a page lists: files (bytes) or messages


@dataclass(frozen=True)
class PagingBound:
    """The most one paged answer may bring in all: ``max_items`` ``what`` of ``max_bytes``
    (wire bytes), else ``error(message)`` is raised."""

    what: str
    max_items: int
    max_bytes: int
    error: Callable[[str], FctkitError]

    def check(self, items: int, size: int) -> None:
        if items > self.max_items or size > self.max_bytes:
            raise self.error(
                f"the server sent more than {self.max_items:,} {self.what} or {self.max_bytes / (1 << 20):g} MiB in "
                f"one answer ({items:,} {self.what} in {size / (1 << 20):.1f} MiB so far): refused (endless data); "
                "nothing it sent was kept"
            )


@dataclass(frozen=True)
class Pages(Generic[Page, Item]):
    """A paged answer: its first and last pages and every page's items, in order."""

    first: Page
    last: Page
    items: list[Item]


def stream_pages(
    ask: Callable[[Page | None, int], Page | None],
    items_of: Callable[[Page], Sequence[Item]],
    bound: PagingBound,
) -> Iterator[Page]:
    """Each page ``ask(previous page, items so far)`` answers (``None`` for the first; it returns
    ``None`` once the previous page was the last), as it arrives, checked against ``bound``: what
    all pages brought is counted, none is kept here."""
    last: Page | None = None
    items = size = 0
    while (page := ask(last, items)) is not None:
        if last is not None and not items_of(last):
            raise bound.error(f"the server sent a page of no {bound.what} and asks for more: refused (endless paging)")
        items += len(items_of(page))
        size += page.ByteSize()
        bound.check(items, size)
        yield page
        last = page


def gather_pages(
    ask: Callable[[Page | None, int], Page | None],
    items_of: Callable[[Page], Sequence[Item]],
    bound: PagingBound,
) -> Pages[Page, Item]:
    """Every page :func:`stream_pages` brings and their ``items_of``, kept in order."""
    found: list[Item] = []
    first: Page | None = None
    last: Page | None = None
    for page in stream_pages(ask, items_of, bound):
        found.extend(items_of(page))
        first = page if first is None else first
        last = page
    assert first is not None and last is not None  # ask answers the first call with a page
    return Pages(first, last, found)
