"""Cost per million tokens from a price per device-hour and a measured or predicted
throughput: price / (tokens/s * 3600) * 1e6."""

from __future__ import annotations


def cost_per_million(price_per_hour: float, tokens_per_s: float, devices: int = 1) -> float:
    if price_per_hour < 0:
        raise ValueError("price per hour must be >= 0")
    if tokens_per_s <= 0:
        raise ValueError("tokens/s must be > 0")
    if devices < 1:
        raise ValueError("devices must be >= 1")
    return price_per_hour * devices / (tokens_per_s * 3600) * 1e6
