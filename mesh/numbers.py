"""Integer arithmetic every package shares (imports nothing): ceiling division, of pages, chunks, shards and rows."""


def ceil_div(a: int, b: int) -> int:
    """The smallest integer >= a / b for b > 0, exactly (no float)."""
    return -(-a // b)
