"""The training core shared by both strategies, and the two strategies."""
