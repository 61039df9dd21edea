"""What can be refused before any process of a run starts (`check_before_start`): every
command that starts a broker and consumers asks it first."""

from __future__ import annotations

import os
import tempfile

from pipeline.runtime.gpus import consumer_placements, detect_gpus, gpus_per_engine
from pipeline.runtime.local import ShmNeeds, check_shm_space
from pipeline.runtime.settings import DEFAULT_CPU_CONSUMERS, LaunchSettings
from pipeline.runtime.tables import broker_config
from pipeline.wire.errors import SettingsError
from pipeline.wire.textfiles import counted


def check_before_start(settings: LaunchSettings, lora_adapters: int = 0) -> None:
    """What can be refused before any process starts: a data directory another user could
    change, one whose socket path does not fit a Unix socket, a consumer contract the
    broker would refuse (consumers would otherwise retry forever against it), GPUs that do
    not divide into engines of tensor x pipeline parallel size, a descriptor limit below the
    broker's need, and fewer consumers than the models a job serves (`lora_adapters` and its
    base model: each consumer serves one)."""
    from pipeline.runtime.datadir import check_data_dir
    from pipeline.runtime.inventory import producer_ring_names
    from pipeline.runtime.processes import check_descriptor_limit

    if settings.data_dir is not None:
        check_data_dir(settings.data_dir)
        config = broker_config(settings.data_dir, settings.broker, "settings")
        left = len(producer_ring_names(settings.data_dir))  # the broker adopts them: each takes a place
        if settings.producers + left > config.max_producers:
            raise SettingsError(f"producers: {settings.producers} and the {counted(left, 'producer ring')} an earlier "
                                f"run left in {settings.data_dir} exceed the {config.max_producers} a broker serves")
    else:
        config = broker_config(os.path.join(tempfile.gettempdir(), "shape-broker-XXXXXXXX"),  # mkdtemp's length
                               settings.broker, "settings")
    config.check_contract(0, settings.max_batch, settings.max_batch_tokens, settings.max_input_len)
    check_descriptor_limit(config)
    placements = consumer_placements(detect_gpus(), gpus_per_engine(settings.engine_options), settings.consumers,
                                     DEFAULT_CPU_CONSUMERS)  # GPUs that do not divide into engines: refused
    consumers = len(placements)
    if lora_adapters + 1 > consumers:
        raise SettingsError(f"--lora-modules: the base model and {counted(lora_adapters, 'LoRA adapter')} are "
                            f"{lora_adapters + 1} models, each served by a consumer of its own, and this run starts "
                            f"{counted(consumers, 'consumer')}: pass --consumers {lora_adapters + 1} or more")
    check_shm_space(ShmNeeds(settings.producers, consumers, config.descriptor_ring_bytes,
                             memory_tier=settings.storage == "memory"))
    if config.min_consumers > consumers:
        raise SettingsError(f"broker.min_consumers {config.min_consumers} is more than the "
                            f"{counted(consumers, 'consumer')} this run starts: dispatch would wait broker.min_consumers_wait_s "
                            f"({config.min_consumers_wait_s:g} s) for consumers that never come; lower it or raise "
                            f"--consumers")
