"""BYOC partitioning for spinn: pattern table and ``partition_for_spinn``."""

from .partition import PartitionSummary, partition_for_spinn, summarize_partition
from .patterns import spinn_patterns

__all__ = ["partition_for_spinn", "PartitionSummary", "summarize_partition", "spinn_patterns"]
