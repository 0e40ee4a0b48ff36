import pytest

from hostmem.units import format_size, parse_fraction, parse_rate, parse_size


@pytest.mark.parametrize(
    "text, expected",
    [
        ("32GiB", 32 * 1024**3),
        ("32 GiB", 32 * 1024**3),
        ("18.4G", int(round(18.4 * 1024**3))),
        ("512MiB", 512 * 1024**2),
        ("0", 0),
        ("4096", 4096),
        (4096, 4096),
        ("61.7GB", 61_700_000_000),
        ("1kB", 1000),
        ("1K", 1024),
        ("  2 tib ", 2 * 1024**4),
    ],
)
def test_parse_size_accepts_human_units(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "12 parsecs", "-1GiB", "1.2.3G", "abc", None, True, -5])
def test_parse_size_rejects_and_quotes_the_input(text):
    with pytest.raises(ValueError) as info:
        parse_size(text)
    assert repr(text) in str(info.value)


def test_format_size_is_human_readable():
    assert format_size(0) == "0 B"
    assert format_size(1023) == "1023 B"
    assert format_size(1536) == "1.5 KiB"
    assert format_size(int(18.4 * 1024**3)) == "18.4 GiB"
    assert format_size(3 * 1024**4) == "3.0 TiB"
    assert format_size(-2 * 1024**2) == "-2.0 MiB"


def test_round_trip_through_format_and_parse():
    for size in (1024, 5 * 1024**2, 7 * 1024**3):
        assert parse_size(format_size(size).replace(" ", "")) == size


def test_rates_and_fractions():
    assert parse_rate("24GB/s") == 24e9
    assert parse_rate("8 GiB/s") == 8 * 1024**3
    assert parse_fraction("75%") == 0.75
    assert parse_fraction(0.5) == 0.5
    for bad in ("24GB", "0GB/s", "fast/s"):
        with pytest.raises(ValueError, match="not a rate"):
            parse_rate(bad)
    for bad in ("120%", "-1", "half"):
        with pytest.raises(ValueError, match="not a fraction"):
            parse_fraction(bad)
