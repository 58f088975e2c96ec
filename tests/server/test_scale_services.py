"""The services of the scale-out backend tests (tests/support/scale_services.py): a throwaway
PostgreSQL cluster and moto's S3 endpoint, both on loopback, answer like the real thing."""

from __future__ import annotations

import psycopg
import pytest

from tests.support.scale_services import s3_environment


def test_postgres_cluster_creates_distinct_databases(postgres_cluster):
    first = postgres_cluster.create_database("scale_services_a")
    second = postgres_cluster.create_database("scale_services_b")
    assert first != second
    assert first == f"postgresql://fctkit@127.0.0.1:{postgres_cluster.port}/scale_services_a"

    with psycopg.connect(first, autocommit=True) as connection:
        assert connection.execute("SELECT 1").fetchone() == (1,)
        assert connection.execute("SELECT current_database()").fetchone() == ("scale_services_a",)
        connection.execute("CREATE TABLE only_in_a (id integer)")
        connection.execute("INSERT INTO only_in_a VALUES (7)")
    with psycopg.connect(second, autocommit=True) as connection:
        assert connection.execute("SELECT current_database()").fetchone() == ("scale_services_b",)
        assert connection.execute("SELECT to_regclass('only_in_a')").fetchone() == (None,)
    with psycopg.connect(first) as connection:
        assert connection.execute("SELECT id FROM only_in_a").fetchall() == [(7,)]

    with pytest.raises(ValueError):
        postgres_cluster.create_database("bad-name; DROP DATABASE postgres")


def test_s3_endpoint_stores_and_returns_objects(s3_endpoint):
    s3_endpoint.create_bucket("scale-services")
    s3 = s3_endpoint.client()
    body = b"0123456789abcdef"
    s3.put_object(Bucket="scale-services", Key="blobs/one", Body=body)

    assert s3.get_object(Bucket="scale-services", Key="blobs/one")["Body"].read() == body
    ranged = s3.get_object(Bucket="scale-services", Key="blobs/one", Range="bytes=2-5")
    assert ranged["Body"].read() == b"2345"
    assert ranged["ContentRange"] == f"bytes 2-5/{len(body)}"

    listing = s3.list_objects_v2(Bucket="scale-services", Prefix="blobs/")
    assert [(item["Key"], item["Size"]) for item in listing["Contents"]] == [("blobs/one", len(body))]

    s3.delete_object(Bucket="scale-services", Key="blobs/one")
    assert s3.list_objects_v2(Bucket="scale-services", Prefix="blobs/")["KeyCount"] == 0
    with pytest.raises(s3.exceptions.NoSuchKey):
        s3.get_object(Bucket="scale-services", Key="blobs/one")

    environment = s3_environment(s3_endpoint.url)
    assert environment == {
        "AWS_ENDPOINT_URL": s3_endpoint.url,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
