"""Step buckets: on CPU a padded token costs compute, so the token buckets are dense."""

from jaxcb.runner import default_token_buckets


def test_cpu_token_buckets_pad_a_step_by_at_most_a_third():
    assert default_token_buckets(2048, "cpu") == [
        1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048
    ]
    assert default_token_buckets(2048, "gpu") == [16, 32, 64, 128, 256, 512, 1024, 2048]
    assert default_token_buckets(50, "cpu") == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 50]
    assert default_token_buckets(3, "cpu") == [1, 2, 3]
