"""What processes and files share: record layouts, control messages, the status record, the error tree."""
