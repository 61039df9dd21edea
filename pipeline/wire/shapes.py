"""The shape vocabulary producers and the broker share, as data only (no imports): a module a
pure policy can read without pulling in a socket or a clock."""

# The signature of the empty shape: prompts with no cacheable components (SPEC §1), the
# reduction of no component hashes (pipeline.producer.signature checks the two agree at
# import). The broker is content-blind, but this one signature it may know: such a shape has
# no prefix for a consumer's cache to keep, so affinity has nothing to save by holding it
# to one consumer (pipeline/broker/selection.py). A producer that names its shapes itself
# (Producer.submit's signature) and declares no components gets no such exemption: the
# broker cannot tell that shape has no prefix.
EMPTY_SHAPE_SIGNATURE = 0x192E_616B_F1CE_9F44
