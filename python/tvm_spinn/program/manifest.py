"""Names of the JSON manifest a spinn build embeds next to its program modules.

``codegen`` writes the manifest module; the runtime executor recognizes (and never executes) it,
and ``report`` reads it. The names live here, below both, so the runtime needs only ``program``.
"""

__all__ = ["MANIFEST_SYMBOL", "MANIFEST_MAGIC"]

#: Symbol of the module holding the manifest (a JSON document for reports, never executed).
MANIFEST_SYMBOL = "__spinn_manifest__"
#: Bytes preceding the JSON document in the manifest module's data.
MANIFEST_MAGIC = b"SPINNMAN"
