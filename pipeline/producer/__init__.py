"""Producer side: shape signatures and the API that submits work items into a ring."""

from pipeline.producer.producer import Producer, ProducerLimits
from pipeline.producer.signature import Signature, signature

__all__ = ["Producer", "ProducerLimits", "Signature", "signature"]
