from django.contrib import admin
from django.urls import path
from shop import views

urlpatterns = [
    path("admin/", admin.site.urls),
    path("invoice/<str:number>/", views.fenced_invoice),
    path("eager/<str:number>/", views.eager_task),
    path("failed-block/<str:number>/", views.released_in_a_failed_block),
]
