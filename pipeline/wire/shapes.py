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

# The signature of a model's solitary pool (pipeline/broker/pool.py): where the broker keeps
# and batches together the items of shapes that share no prefix with any other live shape.
# Its segments are named by it and its batches' descriptors carry it; each of their entries
# names its own shape. No producer may use it (SignatureError: refused at submit, and a
# frame holding it is refused by the broker); a hash landing on it is a 2**-64 event.
POOL_SIGNATURE = 0x736F_6C69_7461_7279  # "solitary"
