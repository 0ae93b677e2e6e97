from django.contrib import admin

from feeds.models import Feed


@admin.register(Feed)
class FeedAdmin(admin.ModelAdmin):
    list_display = ("url", "import_count", "entries", "last_token", "imported_at")
