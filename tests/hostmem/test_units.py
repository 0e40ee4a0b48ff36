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


# ---------------------------------------------------------------- what a person may type

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from hostmem.units import MAX_SIZE, size_option  # noqa: E402

_SETTINGS = settings(database=None, deadline=None, max_examples=300)


@pytest.mark.parametrize("text", ["1.5", "0.5", ".5", "2.25B", 1.5, 0.1])
def test_a_fraction_of_a_byte_is_refused_not_rounded(text):
    with pytest.raises(ValueError, match="a fraction of a byte: add a unit"):
        parse_size(text)


@pytest.mark.parametrize(
    "text, words",
    [
        (float("inf"), "not a finite number"),
        (float("nan"), "not a finite number"),
        ("9" * 400, "larger than any host"),
        (10**400, "larger than any host"),
        ("9223372036854775808", "larger than any host"),
        ("9EiB", "larger than any host"),
        ("8ZiB", "unknown unit"),
    ],
)
def test_sizes_beyond_any_host_are_refused_with_the_input_cut_short(text, words):
    with pytest.raises(ValueError, match=words) as info:
        parse_size(text)
    assert len(str(info.value)) < 200


def test_whole_numbers_and_the_largest_size_still_parse():
    assert parse_size("1.0") == 1 and parse_size(4096.0) == 4096 and parse_size("1.5KiB") == 1536
    assert parse_size(str(MAX_SIZE)) == MAX_SIZE and parse_size("2PiB") == 2 * 1024**5
    assert format_size(MAX_SIZE) == "8.0 EiB"
    for bad in (float("inf"), float("nan"), 0, -1.0, 10**400):
        with pytest.raises(ValueError, match="not a rate"):
            parse_rate(bad)


@_SETTINGS
@given(st.one_of(st.text(max_size=30), st.integers(-(2**80), 2**80), st.floats(), st.none(), st.booleans()))
def test_any_input_is_a_size_in_range_or_a_value_error(value):
    try:
        size = parse_size(value)
    except ValueError as exc:
        assert str(exc).startswith("not a size: ")
    else:
        assert isinstance(size, int) and 0 <= size <= MAX_SIZE


@_SETTINGS
@given(
    st.integers(0, 10**6),
    st.sampled_from(["", "B", "K", "KiB", "M", "MiB", "G", "GiB", "T", "kB", "MB", "GB", "TB", "PiB"]),
    st.sampled_from(["", " "]),
)
def test_a_whole_number_with_a_unit_is_exact(number, unit, space):
    multiplier = parse_size(f"1{unit}") if unit else 1
    if number * multiplier > MAX_SIZE:
        with pytest.raises(ValueError, match="larger than any host"):
            parse_size(f"{number}{space}{unit}")
    else:
        assert parse_size(f"{number}{space}{unit}") == number * multiplier


def test_size_option_reports_through_argparse():
    import argparse

    with pytest.raises(argparse.ArgumentTypeError, match="not a size: 'abc'"):
        size_option("abc")
    assert size_option("2MiB") == 2 * 1024**2


# ---------------------------------------------------------------- what is printed reads back
_UNITS = {"B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3, "TiB": 1024**4, "PiB": 1024**5, "EiB": 1024**6}


@settings(database=None, deadline=None, max_examples=2000)
@given(n=st.integers(0, MAX_SIZE) | st.sampled_from([MAX_SIZE, 2**60, 2**60 - 1, 1024**5 - 1, 1023 * 1024**5]),
       precision=st.integers(0, 3))
def test_what_format_size_prints_parse_size_reads_back_within_its_last_digit(n, precision):
    text = format_size(n, precision)
    back = parse_size(text)  # never refused, EiB and the largest size included
    number, unit = text.split()
    last_digit = _UNITS[unit] * 10.0 ** -len(number.partition(".")[2]) if unit != "B" else 1
    assert abs(back - n) <= last_digit / 2 + 1, (n, text, back)


def test_the_largest_size_prints_and_reads_back():
    assert format_size(MAX_SIZE) == "8.0 EiB"
    assert parse_size(format_size(MAX_SIZE)) == MAX_SIZE == parse_size("8EiB")
    assert parse_size("1 EiB") == 1024**6 and parse_size("2EB") == 2 * 1000**6
    with pytest.raises(ValueError, match="larger than any host"):
        parse_size("8.1 EiB")
    with pytest.raises(ValueError, match="larger than any host"):
        parse_size(str(MAX_SIZE + 1))
