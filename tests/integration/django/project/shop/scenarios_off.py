"""Run with TASKGUARD_LOCKING=off (test_django_project.py): guarded tasks run without
taking locks, their fences pass, and taskguard says once that locking is off."""

from django.test import TransactionTestCase

from shop.models import Invoice
from shop.tasks import write_invoice
from taskguard.contrib.django.models import HeldLock


class LockingOff(TransactionTestCase):
    def test_tasks_run_without_locks(self) -> None:
        with self.assertLogs("taskguard", "WARNING") as logs:
            token = write_invoice.apply(args=("OFF-1",)).get()
            write_invoice.apply(args=("OFF-2",)).get()
        self.assertEqual(sum("locking is OFF" in line for line in logs.output), 1, logs.output)
        self.assertEqual(Invoice.objects.get(number="OFF-1").token, token)
        self.assertFalse(HeldLock.objects.exists())
