"""Issue 41, defect 4, under Django's own test runner
(tests/integration/django/test_django_fence_release.py): a view fences inside a
nested atomic block under the request's transaction and releases before it
commits. The release used to wait for the fence's own row lock (PostgreSQL,
MariaDB) or write lock (SQLite) until the call timeout, fail, and roll the
request's writes back; now it happens right after the transaction ends."""

import time
import uuid

from django.test import TransactionTestCase
from tgsite.celery import app

from shop.models import Invoice
from taskguard.config import guard_for

#: Well under the call timeout (10 s) that a release waiting for itself took.
QUICK = 4.0


class ReleaseInsideTheFencedTransaction(TransactionTestCase):
    def _free(self, key: str) -> bool:
        info = guard_for(app).get(key)
        return info is None or not info.held

    def test_the_view_commits_quickly_and_the_key_is_free(self) -> None:
        number = uuid.uuid4().hex[:8]
        started = time.monotonic()
        page = self.client.get(f"/invoice/{number}/")
        took = time.monotonic() - started
        self.assertEqual(page.status_code, 200, page.content[:2000])
        self.assertLess(took, QUICK)
        self.assertTrue(page.json()["released"])
        numbers = set(Invoice.objects.values_list("number", flat=True))
        self.assertEqual(numbers, {number, f"{number}-after"})
        self.assertTrue(self._free(f"invoice:{number}"))

    def test_a_view_that_fails_after_its_release_rolls_back_and_frees_the_key(self) -> None:
        number = uuid.uuid4().hex[:8]
        self.client.raise_request_exception = False
        started = time.monotonic()
        page = self.client.get(f"/invoice/{number}/", {"fail": "1"})
        self.assertEqual(page.status_code, 500)
        self.assertLess(time.monotonic() - started, QUICK)
        self.assertFalse(Invoice.objects.exists())
        self.assertTrue(self._free(f"invoice:{number}"))

    def test_an_eager_guarded_task_in_the_views_transaction(self) -> None:
        number = uuid.uuid4().hex[:8]
        started = time.monotonic()
        page = self.client.get(f"/eager/{number}/")
        self.assertEqual(page.status_code, 200, page.content[:2000])
        self.assertLess(time.monotonic() - started, QUICK)
        numbers = set(Invoice.objects.values_list("number", flat=True))
        self.assertEqual(numbers, {number, f"{number}-after"})
        self.assertTrue(self._free(f"invoice:{number}"))

    def test_a_release_in_a_nested_block_that_rolls_back(self) -> None:
        """Django drops the block's on_commit hooks with its savepoint: the release is
        put off again, to the end of the request's transaction."""
        number = uuid.uuid4().hex[:8]
        started = time.monotonic()
        page = self.client.get(f"/failed-block/{number}/")
        self.assertEqual(page.status_code, 200, page.content[:2000])
        self.assertLess(time.monotonic() - started, QUICK)
        numbers = set(Invoice.objects.values_list("number", flat=True))
        self.assertEqual(numbers, {f"{number}-after"})
        self.assertTrue(self._free(f"invoice:{number}"))
