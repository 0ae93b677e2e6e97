"""taskguard for Django projects: add ``"taskguard.contrib.django"`` to ``INSTALLED_APPS``.

What the app gives a project (see docs/django.md):

* settings in Django's style (``TASKGUARD_DATABASE_ALIAS`` and the other
  ``TASKGUARD_*`` names), checked by ``manage.py check``, handed to every Celery app;
* the lock database built from ``DATABASES`` (following the test database under
  Django's test runner and pytest-django);
* ``manage.py migrate`` creating the same tables as ``taskguard db upgrade``;
* admin pages for held locks and lock history, with an audited force-release;
* ``manage.py taskguard ...`` running the ``taskguard`` command line.
"""
