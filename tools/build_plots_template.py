"""Build the offline HTML template for `dvc plots show` (.dvc/plots/offline.html).

DVC's default page loads vega, vega-lite and vega-embed from a CDN, so it stays blank without network.
This template inlines pinned minified builds of the three libraries and leaves out DVC's `{scripts}`
placeholder, so the CDN <script src=...> tags are never written into the page.

The committed template is what `dvc plots show` uses (configured in .dvc/config as
`plots.html_template = plots/offline.html`, a path relative to .dvc/). This script only rebuilds it:

    python tools/build_plots_template.py                    # download the pinned npm tarballs, write the template
    python tools/build_plots_template.py --tarballs DIR     # use DIR/<name>-<version>.tgz instead of downloading
    python tools/build_plots_template.py --check            # exit 1 if the committed template differs
    python tools/build_plots_template.py --verify           # offline: inlined code matches the pinned sha256

Every tarball and every extracted build is checked against the sha256 pinned below. The only change made to
a build is dropping its trailing `//# sourceMappingURL=` line, so `--verify` can restore the upstream bytes
from the template and check them without network. Standard library only.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import sys
import tarfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / ".dvc" / "plots" / "offline.html"
REGISTRY = "https://registry.npmjs.org"


@dataclass(frozen=True)
class Pin:
    name: str
    version: str
    tarball_sha256: str
    member: str  # path of the minified UMD build inside the tarball
    build_sha256: str

    @property
    def tarball_name(self) -> str:
        return f"{self.name}-{self.version}.tgz"

    @property
    def url(self) -> str:
        return f"{REGISTRY}/{self.name}/-/{self.tarball_name}"


# Load order matters: vega-lite needs the global `vega`, vega-embed needs `vega` and `vegaLite`.
# vega 5 / vega-lite 5 / vega-embed 6: the specs dvc-render emits declare the vega-lite v5 schema.
PINS = (
    Pin(
        "vega",
        "5.33.1",
        "1b8504b6731c5311be3269c4d84ca996a5cc293bc772283293ede20c490e16c3",
        "package/build/vega.min.js",
        "463f3db6a40b20e9747b4ed38f37ed0add508838f9141b1cf8366784b07b30c8",
    ),
    Pin(
        "vega-lite",
        "5.23.0",
        "e4cbfdd8f6f1abe381c59cd558fd6a559c12b1496bfdf2e0c3295263a40fe4da",
        "package/build/vega-lite.min.js",
        "58c27358e26f2d319cf62f45bc17a4c8362f08645001df2ec8d341eee4097c7f",
    ),
    Pin(
        "vega-embed",
        "6.29.0",
        "ecf1ee709c2bac9e0a4ead6908114b05b62c71493e10a8a4308109bb070f8eb1",
        "package/build/vega-embed.min.js",
        "12d02acfbe3ec59ef9a37dd4822a2e04e2961b5bbb671bbe661d2221715b99da",
    ),
)

# The three packages share this licence text (BSD-3-Clause, University of Washington Interactive Data Lab);
# it is copied from the vega-lite tarball's LICENSE and reproduced in the template as clause 2 asks.
LICENSE_MEMBER = ("vega-lite", "package/LICENSE")

# Placeholders dvc-render substitutes with str.replace. `{scripts}` must stay out of the template:
# it is where dvc-render would write its CDN <script src=...> tags.
PLOTS_PLACEHOLDER = "{plot_divs}"
REFRESH_PLACEHOLDER = "{refresh_tag}"
FORBIDDEN_PLACEHOLDER = "{scripts}"

PAGE = """<!DOCTYPE html>
<html>
<head>
    <meta charset="utf-8">
    {refresh_tag}
    <title>DVC Plot</title>
    <!--
    Offline template for `dvc plots show`: the plotting libraries are inlined below, nothing is fetched.
    Rebuild with tools/build_plots_template.py; do not edit by hand.
@@PINS@@
@@LICENSE@@
    -->
@@SCRIPTS@@
    <style>
        table {
            border-spacing: 15px;
        }
    </style>
</head>
<body>
    {plot_divs}
</body>
</html>
"""


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fetch_tarball(pin: Pin, tarball_dir: Path | None) -> bytes:
    if tarball_dir is not None:
        data = (tarball_dir / pin.tarball_name).read_bytes()
    else:
        with urllib.request.urlopen(pin.url, timeout=120) as resp:
            data = resp.read()
    got = sha256(data)
    if got != pin.tarball_sha256:
        raise SystemExit(f"{pin.tarball_name}: sha256 {got} != pinned {pin.tarball_sha256}")
    return data


def read_member(tarball: bytes, member: str) -> bytes:
    with tarfile.open(fileobj=io.BytesIO(tarball), mode="r:gz") as tar:
        f = tar.extractfile(member)
        if f is None:
            raise SystemExit(f"{member}: not a regular file in the tarball")
        return f.read()


def source_map_trailer(pin: Pin) -> str:
    return f"\n//# sourceMappingURL={Path(pin.member).name}.map\n"


def script_open(pin: Pin) -> str:
    return f"    <script>/* {pin.name}@{pin.version} */\n"


SCRIPT_CLOSE = "\n    </script>"


def strip_source_map(pin: Pin, js: str) -> str:
    """Drop the trailing `//# sourceMappingURL=...` line (the .map file is not shipped)."""
    trailer = source_map_trailer(pin)
    if not js.endswith(trailer):
        raise SystemExit(f"{pin.name}: build does not end with {trailer!r}")
    return js.removesuffix(trailer)


def check_inlinable(name: str, js: str) -> None:
    lowered = js.lower()
    for bad in ("</script", "<!--", "<script"):
        if bad in lowered:
            raise SystemExit(f"{name}: contains {bad!r}, cannot be inlined in a <script> element as is")
    for placeholder in (PLOTS_PLACEHOLDER, REFRESH_PLACEHOLDER, FORBIDDEN_PLACEHOLDER):
        if placeholder in js:
            raise SystemExit(f"{name}: contains the dvc-render placeholder {placeholder!r}")


def build(tarball_dir: Path | None = None) -> str:
    scripts: list[str] = []
    pin_lines: list[str] = []
    license_text = ""
    for pin in PINS:
        tarball = fetch_tarball(pin, tarball_dir)
        build_bytes = read_member(tarball, pin.member)
        got = sha256(build_bytes)
        if got != pin.build_sha256:
            raise SystemExit(f"{pin.name} {pin.member}: sha256 {got} != pinned {pin.build_sha256}")
        js = strip_source_map(pin, build_bytes.decode("utf-8"))
        check_inlinable(pin.name, js)
        scripts.append(f"{script_open(pin)}{js}{SCRIPT_CLOSE}")
        pin_lines.append(
            f"    {pin.name}@{pin.version}  {pin.url}\n"
            f"        tarball sha256 {pin.tarball_sha256}\n"
            f"        {pin.member.removeprefix('package/')} sha256 {pin.build_sha256}"
        )
        if pin.name == LICENSE_MEMBER[0]:
            license_text = read_member(tarball, LICENSE_MEMBER[1]).decode("utf-8")

    if "--" in license_text:
        raise SystemExit("licence text contains '--', cannot go into an HTML comment")
    license_block = (
        "    vega, vega-lite and vega-embed are distributed under the BSD-3-Clause licence:\n\n"
        + "\n".join(f"    {line}".rstrip() for line in license_text.strip().splitlines())
    )
    page = (
        PAGE.replace("@@PINS@@", "\n".join(pin_lines))
        .replace("@@LICENSE@@", license_block)
        .replace("@@SCRIPTS@@", "\n".join(scripts))
    )
    problems = verify(page)
    if problems:
        raise SystemExit("\n".join(problems))
    return page


def verify(page: str) -> list[str]:
    """Problems with a built template: placeholders, and inlined code that is not the pinned upstream build."""
    problems = []
    if page.count(PLOTS_PLACEHOLDER) != 1:
        problems.append(f"template must contain {PLOTS_PLACEHOLDER} exactly once")
    if FORBIDDEN_PLACEHOLDER in page:
        problems.append(f"template must not contain {FORBIDDEN_PLACEHOLDER}")
    if "<script src" in page.lower():
        problems.append("template must not load scripts by URL")
    for pin in PINS:
        start = page.find(script_open(pin))
        if start < 0:
            problems.append(f"{pin.name}@{pin.version}: not inlined")
            continue
        start += len(script_open(pin))
        end = page.find(SCRIPT_CLOSE, start)
        if end < 0:
            problems.append(f"{pin.name}@{pin.version}: unterminated <script>")
            continue
        got = sha256((page[start:end] + source_map_trailer(pin)).encode("utf-8"))
        if got != pin.build_sha256:
            problems.append(
                f"{pin.name}@{pin.version}: inlined code sha256 {got} != pinned {pin.build_sha256}"
            )
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"template path (default {DEFAULT_OUT})"
    )
    parser.add_argument("--tarballs", type=Path, help="directory holding the pinned .tgz files (no download)")
    parser.add_argument("--check", action="store_true", help="compare with --out instead of writing it")
    parser.add_argument("--verify", action="store_true", help="offline: check the inlined code in --out")
    args = parser.parse_args(argv)

    if args.verify:
        problems = verify(args.out.read_bytes().decode("utf-8"))
        for problem in problems:
            print(f"{args.out}: {problem}", file=sys.stderr)
        if not problems:
            print(
                f"{args.out}: inlined " + ", ".join(f"{p.name}@{p.version}" for p in PINS) + " match the pins"
            )
        return 1 if problems else 0

    page = build(args.tarballs)
    data = page.encode("utf-8")
    if args.check:
        current = args.out.read_bytes() if args.out.exists() else b""
        if current != data:
            print(f"{args.out}: differs from the pinned build", file=sys.stderr)
            return 1
        print(f"{args.out}: up to date ({len(data)} bytes)")
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(data)
    print(f"wrote {args.out} ({len(data)} bytes, sha256 {sha256(data)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
