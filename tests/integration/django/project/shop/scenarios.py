"""Scenarios run by Django's own test runner (``manage.py test shop.scenarios``) in
a subprocess of tests/integration/django/test_django_project.py, once on
PostgreSQL and once on SQLite.

TransactionTestCase, not TestCase: taskguard works on its own connections, which
must see (and, on SQLite, be able to write next to) what the test commits.
"""

import time
import uuid

from django.contrib.auth.models import Permission, User
from django.db import connection, connections, transaction
from django.test import TransactionTestCase
from sqlalchemy.engine import make_url
from tgsite.celery import app

from shop.models import Invoice
from shop.tasks import write_invoice
from taskguard import LeaseLost, TaskGuard
from taskguard.config import guard_for
from taskguard.contrib.django.conf import database_url
from taskguard.contrib.django.models import HeldLock, LockEvent

CHANGELIST = "/admin/taskguard/heldlock/"
HISTORY = "/admin/taskguard/lockevent/"


def _key(prefix: str) -> str:
    return f"{prefix}:https://example.com/{uuid.uuid4().hex[:8]}.rss"


class LocksFollowTheTestDatabase(TransactionTestCase):
    def test_celery_app_guard_uses_the_test_database(self) -> None:
        test_db = connections["default"].settings_dict["NAME"]
        url = make_url(str(app.conf.taskguard_database_url))
        self.assertTrue(str(url.database).endswith(str(test_db)), (url, test_db))
        self.assertIn("test", str(url.database))
        key = _key("follow")
        guard = guard_for(app)
        lease = guard.acquire(key, ttl=30, task_name="shop.follow")
        self.assertIsNotNone(lease)
        # The Django ORM (test database) sees the lock the Celery app's guard took.
        self.assertEqual(HeldLock.objects.filter(key=key).count(), 1)
        assert lease is not None
        guard.release(lease)
        self.assertEqual(HeldLock.objects.filter(key=key).count(), 0)


class SettingsReachTheCeleryApp(TransactionTestCase):
    def test_taskguard_settings_from_django(self) -> None:
        self.assertIs(app.conf.taskguard_history, True)
        self.assertEqual(app.conf.taskguard_default_ttl, 42.0)
        self.assertIn("taskguard-reaper", app.conf.beat_schedule)
        self.assertTrue(guard_for(app).history)

    def test_the_apps_database_url_makes_a_guard(self) -> None:
        """It is a DjangoDatabaseURL object, not a str: TaskGuard(that) raised."""
        guard = TaskGuard(app.conf.taskguard_database_url)
        try:
            lease = guard.acquire(_key("url"), ttl=30)
            self.assertIsNotNone(lease)
            assert lease is not None
            self.assertTrue(guard.release(lease))
        finally:
            guard.dispose()


class AdminPages(TransactionTestCase):
    def setUp(self) -> None:
        self.guard = TaskGuard(database_url())
        self.key = _key("feed")
        self.lease = self.guard.acquire(
            self.key, ttl=60, task_name="shop.import_feed", task_id="t-1", hostname="w1", pid=42
        )
        assert self.lease is not None
        view = Permission.objects.filter(
            content_type__app_label="taskguard", codename__in=["view_heldlock", "view_lockevent"]
        )
        self.assertEqual(view.count(), 2)
        self.operator = User.objects.create_user("olga", password="x", is_staff=True)
        self.operator.user_permissions.add(
            *view, Permission.objects.get(codename="force_release_lock")
        )
        self.viewer = User.objects.create_user("victor", password="x", is_staff=True)
        self.viewer.user_permissions.add(*view)

    def tearDown(self) -> None:
        self.guard.dispose()

    def _held(self) -> bool:
        info = self.guard.get(self.key)
        return info is not None and info.held

    def test_held_locks_are_listed_and_searchable(self) -> None:
        self.client.force_login(self.operator)
        page = self.client.get(CHANGELIST)
        self.assertEqual(page.status_code, 200)
        self.assertContains(page, self.key)
        self.assertContains(page, "shop.import_feed")
        self.assertContains(page, "force_release")
        found = self.client.get(CHANGELIST, {"q": self.key.split("/")[-1]})
        self.assertContains(found, self.key)
        none = self.client.get(CHANGELIST, {"q": "no-such-key"})
        self.assertNotContains(none, self.key)
        filtered = self.client.get(CHANGELIST, {"task_name": "shop.import_feed"})
        self.assertContains(filtered, self.key)
        self.assertEqual(self.client.get("/admin/").status_code, 200)
        self.assertEqual(self.client.get(HISTORY).status_code, 200)
        self.assertEqual(self.client.get(HISTORY, {"event": "force_released"}).status_code, 200)

    def test_force_release_is_audited_with_the_user_name(self) -> None:
        self.client.force_login(self.operator)
        response = self.client.post(
            CHANGELIST, {"action": "force_release", "_selected_action": [self.key]}
        )
        self.assertEqual(response.status_code, 302)
        self.assertFalse(self._held())
        self.assertFalse(self.guard.release(self.lease))  # the holder lost it
        event = LockEvent.objects.get(key=self.key, event="force_released")
        self.assertIn("'olga'", str(event.detail))
        self.assertEqual(event.owner, self.lease.owner)
        self.assertEqual(event.token, self.lease.token)
        self.assertEqual(event.task_name, "shop.import_feed")
        history = self.client.get(HISTORY, {"q": self.key})
        self.assertContains(history, "olga")
        self.assertNotContains(self.client.get(CHANGELIST), self.key)

    def test_a_user_without_the_permission_is_refused(self) -> None:
        self.client.force_login(self.viewer)
        page = self.client.get(CHANGELIST)
        self.assertEqual(page.status_code, 200)
        self.assertContains(page, self.key)
        self.assertNotContains(page, "force_release")
        self.client.post(CHANGELIST, {"action": "force_release", "_selected_action": [self.key]})
        self.assertTrue(self._held())
        self.assertFalse(LockEvent.objects.filter(key=self.key).exists())

    def test_companion_rows_are_listed_on_request(self) -> None:
        """Issue 27, item 7: finished runs' records crowded "Held locks"."""
        companions = [f"{self.key}#pending", f"taskguard:finished:{uuid.uuid4().hex}"]
        for key in companions:
            self.assertIsNotNone(self.guard.acquire(key, ttl=60, task_name="shop.import_feed"))
        self.client.force_login(self.viewer)
        page = self.client.get(CHANGELIST)
        self.assertContains(page, self.key)
        for key in companions:
            self.assertNotContains(page, key)
        self.assertContains(page, "companion rows")
        only = self.client.get(CHANGELIST, {"rows": "companions"})
        for key in companions:
            self.assertContains(only, key)
        self.assertNotContains(only, f"{self.key}</")
        every = self.client.get(CHANGELIST, {"rows": "all"})
        for key in (self.key, *companions):
            self.assertContains(every, key)

    def test_control_and_bidi_characters_are_escaped(self) -> None:
        """Issue 28 F: ESC, BEL and U+202E reached the pages raw (the CLI escapes them)."""
        history = TaskGuard(database_url(), history=True)
        try:
            key = f"evil\x1b[31m:{uuid.uuid4().hex[:6]}\u202etxt.exe"
            lease = history.acquire(key, ttl=60, task_name="shop.\x07bell", hostname="w\u202e1")
            assert lease is not None
            history.release(lease)
            held = history.acquire(key, ttl=60, task_name="shop.\x07bell", hostname="w\u202e1")
            assert held is not None
        finally:
            history.dispose()
        self.client.force_login(self.viewer)
        for url in (CHANGELIST, HISTORY):
            page = self.client.get(url).content.decode()
            for raw in ("\x1b", "\x07", "\u202e"):
                self.assertNotIn(raw, page, url)
            self.assertIn("evil\\x1b[31m", page, url)
            self.assertIn("\\u202etxt.exe", page, url)
            self.assertIn("shop.\\x07bell", page, url)
            self.assertIn("w\\u202e1", page, url)

    def test_the_history_marks_a_grant_that_was_taken_over(self) -> None:
        history = TaskGuard(database_url(), history=True)
        try:
            key = _key("crash")
            crashed = history.acquire(key, ttl=0.3, task_name="shop.crashed")
            handed = history.acquire(_key("handed"), ttl=30, task_name="shop.handed")
            assert crashed is not None and handed is not None
            history.release(handed)
            time.sleep(0.5)
            self.assertIsNotNone(history.acquire(key, ttl=30, task_name="shop.next"))
        finally:
            history.dispose()
        self.client.force_login(self.viewer)
        page = self.client.get(HISTORY).content.decode()
        marked = [line for line in page.splitlines() if "then taken over" in line]
        self.assertEqual(len(marked), 1, page)

    def test_nothing_can_be_added_changed_or_deleted(self) -> None:
        self.client.force_login(self.operator)
        self.assertEqual(self.client.get(CHANGELIST + "add/").status_code, 403)
        self.assertNotContains(self.client.get(CHANGELIST), "delete_selected")


class FenceWithTheOrm(TransactionTestCase):
    def setUp(self) -> None:
        self.guard = TaskGuard(database_url())

    def tearDown(self) -> None:
        self.guard.dispose()

    def test_guarded_task_fences_its_orm_write(self) -> None:
        token = write_invoice.apply(args=("A-1",)).get()
        invoice = Invoice.objects.get(number="A-1")
        self.assertEqual(invoice.token, token)

    def test_a_stale_holders_write_is_rejected(self) -> None:
        key = _key("invoice")
        stale = self.guard.acquire(key, ttl=1)
        assert stale is not None
        time.sleep(1.3)
        fresh = self.guard.acquire(key, ttl=30)
        assert fresh is not None
        with self.assertRaises(LeaseLost), transaction.atomic():
            Invoice.objects.create(number="stale", token=stale.token)
            stale.fence(connection)
        self.assertFalse(Invoice.objects.filter(number="stale").exists())
        with transaction.atomic():
            token = fresh.fence(connection)
            Invoice.objects.create(number="fresh", token=token)
        self.assertEqual(Invoice.objects.get(number="fresh").token, fresh.token)
        self.guard.release(fresh)

    def test_fence_outside_atomic_is_refused(self) -> None:
        from taskguard.exceptions import ConfigurationError

        lease = self.guard.acquire(_key("invoice"), ttl=30)
        assert lease is not None
        with self.assertRaises(ConfigurationError):
            lease.fence(connection)
