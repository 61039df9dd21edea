"""`pipeline tools ...`: read-only commands over the store (dump, tombstones, verify)."""

from __future__ import annotations

import json
import sys

import click

from pipeline.broker.storage.inspect import dump_segment, tombstone_rows, verify
from pipeline.errors import SegmentFormatError


@click.group("tools")
def tools() -> None:
    """Inspect and verify the disk tier's segment files (read-only)."""


@tools.command("dump-segment")
@click.argument("path", type=click.Path(exists=True, dir_okay=False))
@click.option("--entries", "max_entries", type=int, default=None, help="List at most this many entries.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def dump_segment_command(path: str, max_entries: int | None, as_json: bool) -> None:
    """Header and entries of one segment: state, lengths, checksum status."""
    try:
        dump = dump_segment(path, max_entries)
    except SegmentFormatError as exc:
        raise click.ClickException(str(exc)) from exc
    if as_json:
        click.echo(json.dumps(dump, indent=2))
        return
    for key, value in dump["header"].items():
        click.echo(f"{key:>14}: {value:#x}" if key == "signature" else f"{key:>14}: {value}")
    scanned = dump["scanned"]
    click.echo(f"{'scanned':>14}: {scanned['entries']} entries ({scanned['live']} live, "
               f"{scanned['tombstones']} tombstones), data ends at {scanned['data_end']}, "
               f"counts agree: {scanned['counts_agree']}")
    if scanned["torn_at"] is not None:
        click.echo(f"{'torn tail':>14}: {scanned['torn_bytes']} bytes at offset {scanned['torn_at']}")
    if scanned["corrupt_at"] is not None:
        click.echo(f"{'CORRUPT':>14}: offset {scanned['corrupt_at']}: {scanned['corrupt_reason']}")
    click.echo(f"{'offset':>10} {'state':<9} {'length':>7} {'item_id':>20} {'producer':>8} {'seq':>10} {'checksum':>8}")
    for e in dump["entries"]:
        click.echo(f"{e['offset']:>10} {e['state']:<9} {e['length']:>7} {e['item_id']:>20} "
                   f"{e['producer_id']:>8} {e['seq']:>10} {e['checksum']:>8}")


@tools.command("dump-tombstones")
@click.argument("data_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def dump_tombstones_command(data_dir: str, as_json: bool) -> None:
    """Per segment: live and tombstoned entries, the deleted count, and whether they agree."""
    rows = tombstone_rows(data_dir)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    click.echo(f"{'live':>8} {'tombs':>8} {'deleted':>8} {'agree':>5}  segment")
    for row in rows:
        if "error" in row:
            click.echo(f"{'':>8} {'':>8} {'':>8} {'ERROR':>5}  {row['error']}")
        else:
            click.echo(f"{row['live']:>8} {row['tombstones']:>8} {row['deleted_count']:>8} "
                       f"{'yes' if row['agree'] else 'NO':>5}  {row['path']}")


@tools.command("verify")
@click.argument("data_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def verify_command(data_dir: str, as_json: bool) -> None:
    """Exit 0 only when every entry is accounted for, checksums hold and counts agree."""
    result = verify(data_dir)
    if as_json:
        click.echo(json.dumps({
            "ok": result.ok, "segments": result.segments, "entries": result.entries,
            "live": result.live, "tombstones": result.tombstones,
            "bytes_scanned": result.bytes_scanned, "problems": result.problems,
        }, indent=2))
    else:
        click.echo(f"{result.segments} segments, {result.entries} entries "
                   f"({result.live} live, {result.tombstones} tombstones), {result.bytes_scanned} bytes")
        for problem in result.problems:
            click.echo(f"PROBLEM: {problem}")
        click.echo("OK" if result.ok else f"FAILED: {len(result.problems)} problems")
    sys.exit(0 if result.ok else 1)
