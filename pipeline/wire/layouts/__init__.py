"""Every record layout of the pipeline, declared once: producer, broker, consumer and tools
import it from here, one module per kind of record: `frames` (a producer's ring records, item
ids), `segments` (segment files and their entries), `names` (where segments live under a data
directory), `storelog` (the store's log), `descriptors` (a consumer's descriptor
ring). Each layout is a numpy structured dtype whose offset table is
checked at import (`shm.layout.checked_dtype`)."""
