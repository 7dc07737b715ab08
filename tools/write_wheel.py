"""Writes a wheel (PEP 427): the given files, then METADATA, WHEEL, entry_points.txt and a
RECORD holding every member's sha256 and size."""

import argparse
import base64
import hashlib
import zipfile

_EPOCH = (1980, 1, 1, 0, 0, 0)  # fixed timestamps: the same inputs give the same wheel


def _record_line(path, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{path},sha256={digest},{len(data)}"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--version", required=True)
    parser.add_argument("--tag", required=True)
    parser.add_argument("--summary", required=True)
    parser.add_argument("--requires", action="append", default=[])
    parser.add_argument("--extra-requires", action="append", default=[],
                        help="extra:requirement, for `pip install 'name[extra]'`")
    parser.add_argument("--entry-point", action="append", default=[])
    parser.add_argument("--file", action="append", default=[], help="archive_path=source_path")
    args = parser.parse_args()

    dist_info = f"{args.name}-{args.version}.dist-info"
    extras = {}
    for item in args.extra_requires:
        extra, _, requirement = item.partition(":")
        extras.setdefault(extra, []).append(requirement)
    metadata = "\n".join([
        "Metadata-Version: 2.1",
        f"Name: {args.name}",
        f"Version: {args.version}",
        f"Summary: {args.summary}",
        "Requires-Python: ==3.11.*",
        *[f"Requires-Dist: {r}" for r in args.requires],
        *[line for extra, requirements in sorted(extras.items())
          for line in [f"Provides-Extra: {extra}"] +
          [f'Requires-Dist: {r}; extra == "{extra}"' for r in requirements]],
    ]) + "\n"
    wheel = "\n".join([
        "Wheel-Version: 1.0",
        "Generator: torch_xla_ext tools/write_wheel.py",
        "Root-Is-Purelib: false",
        f"Tag: {args.tag}",
    ]) + "\n"
    groups = {}
    for entry in args.entry_point:
        group, _, spec = entry.partition(":")
        groups.setdefault(group, []).append(spec)
    entry_points = "".join(f"[{group}]\n" + "".join(f"{s}\n" for s in specs) + "\n"
                           for group, specs in sorted(groups.items()))

    records = []
    with zipfile.ZipFile(args.out, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        def add(path, data, executable=False):
            info = zipfile.ZipInfo(path, date_time=_EPOCH)
            info.external_attr = (0o755 if executable else 0o644) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, data)
            records.append(_record_line(path, data))

        for item in sorted(args.file):
            path, _, source = item.partition("=")
            with open(source, "rb") as f:
                add(path, f.read(), executable=path.endswith(".so"))
        add(f"{dist_info}/METADATA", metadata.encode())
        add(f"{dist_info}/WHEEL", wheel.encode())
        add(f"{dist_info}/entry_points.txt", entry_points.encode())
        record_path = f"{dist_info}/RECORD"
        info = zipfile.ZipInfo(record_path, date_time=_EPOCH)
        zf.writestr(info, "\n".join(records + [f"{record_path},,"]) + "\n")


if __name__ == "__main__":
    main()
